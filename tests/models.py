"""Models shared by the test modules: the tutorial's LeNet-5 itself, so tests train what users run."""
import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "lenet_tutorial", pathlib.Path(__file__).parent.parent / "tutorials" / "lenet.py"
)
_lenet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_lenet)
LeNet5 = _lenet.LeNet5
