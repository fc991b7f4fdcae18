"""The viewer: a static page and its JSON routes, served by `rollout-store view` and by the
capture server, and the Host names a local server answers.
"""
