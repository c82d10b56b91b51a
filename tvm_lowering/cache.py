"""In-memory LRU cache of compiled programs, keyed by structural graph key."""
import collections


class CompileCache:
    """Least-recently-used map from a graph key to its compiled program.

    A graph key is a deep tuple (hundreds of nested tuples for a LeNet-5 step) that Python
    hashes anew on every lookup. A training loop asks for the same key step after step, so
    the last hit is compared first: equality of two such keys mostly meets shared objects
    (op names, argument templates, metas) and costs less than hashing one.
    """

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._entries = collections.OrderedDict()
        self._last = None  # (key, program) of the last hit: the most recently used entry

    def get(self, key):
        """Return the program cached under `key`, or None."""
        last = self._last
        if last is not None and last[0] == key:
            return last[1]
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self._last = (key, entry)
        return entry

    def put(self, key, program):
        """Store `program` under `key`, evicting the least recently used entry when full."""
        self._last = None
        self._entries[key] = program
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self):
        """Drop every entry."""
        self._last = None
        self._entries.clear()

    def __len__(self):
        return len(self._entries)
