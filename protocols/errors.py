"""The root of yatt's error tree and the wire's own error, defined at the bottom layer so
that the codec raises them without importing the runtime above it. ``yatt.errors``
re-exports both; catch them from there."""

from __future__ import annotations


class YattError(Exception):
    """Base of every error yatt raises on purpose."""


class ProtocolError(YattError):
    """A message could not be decoded or did not match its schema. Names the field."""
