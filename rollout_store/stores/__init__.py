"""Content stores: the protocol (`ContentStore`, `content_key`) and its backends (memory,
directory, Redis, S3), which every graph, process or machine can share.
"""
