"""Models shared by the test modules: the tutorials' LeNet-5 itself, so tests train what users run."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "tutorials"))  # as when a tutorial runs

from mnist_models import LeNet5  # noqa: E402,F401
