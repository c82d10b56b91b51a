"""Random ops drawing from a seed that is a graph input."""
