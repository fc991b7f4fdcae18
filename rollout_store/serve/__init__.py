"""The capture server: sessions, the OpenAI and Anthropic routes, server-sent events, the
stub engine, replicas and `capture()`.
"""
