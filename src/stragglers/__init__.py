"""stragglers: find, explain and remove stragglers in distributed deep-learning training."""

__version__ = "0.1.0"
