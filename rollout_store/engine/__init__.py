"""The engine's Python half: blob tables, value intake and rebuild, stored turns, the request
store and linking.

Its work moves into the compiled engine (`rollout_store._core`) step by step; each step deletes
the module it replaces.
"""
