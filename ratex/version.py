"""ratex's version, in a module of its own so the core can name it without importing the package."""
__version__ = "0.1.0"
