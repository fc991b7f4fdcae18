"""The anchor's shapes: `TurnNode`, `RawJSON`, `TrainingSequence`, a call's `Timeline` and
the drift record. The lowest wing: it imports nothing of the package but `errors`.
"""
