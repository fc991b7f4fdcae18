"""Rollout files: frames, the writer and the loader (`save`, `load`, append logs), verify,
recover and repair.
"""
