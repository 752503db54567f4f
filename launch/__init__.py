"""The launcher: one config in, every role of the run out as processes (``python -m launch``)."""
