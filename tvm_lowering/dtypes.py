"""torch dtype <-> TVM dtype string."""
import torch

_TO_TVM = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


def to_tvm(dtype: torch.dtype) -> str:
    """Return the TVM dtype string for a torch dtype."""
    try:
        return _TO_TVM[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no TVM equivalent; supported: {sorted(map(str, _TO_TVM))}") from None
