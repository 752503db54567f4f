"""The roles that hold models: generator, reward and trainer workers, and their engines."""
