"""In-memory LRU cache of compiled programs, keyed by structural graph key."""
import collections


class CompileCache:
    """Least-recently-used map from a graph key to its compiled program."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._entries = collections.OrderedDict()

    def get(self, key):
        """Return the program cached under `key`, or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key, program):
        """Store `program` under `key`, evicting the least recently used entry when full."""
        self._entries[key] = program
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self):
        """Drop every entry."""
        self._entries.clear()

    def __len__(self):
        return len(self._entries)
