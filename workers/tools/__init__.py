"""Offline tools beside the engine: a tiny random-weight model for tests, models pulled from package wheels."""
