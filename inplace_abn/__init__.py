"""In-Place Activated BatchNorm for memory-efficient training.

Public API:
    ABN, InPlaceABN, InPlaceABNSync         modules (drop-in for the original package)
    functions.inplace_abn, inplace_abn_sync functional forms
    AGN, InPlaceAGN, inplace_agn             activated GroupNorm: modules and functional form
    use_backend                              switch native / pure-PyTorch kernels
    convert_sync                             InPlaceABN/ABN -> synchronised layers (torch.distributed)
    fuse_for_inference, FoldedABN            eval-mode layers -> standard operators (export, ONNX)
"""
from ._backend import HAS_NATIVE, use_backend
from .abn import ABN, InPlaceABN, InPlaceABNSync
from .functions import inplace_abn, inplace_abn_sync
from .groupnorm import AGN, InPlaceAGN, inplace_agn
from .convert import convert_model
from .fuse import FoldedABN, fuse_for_inference
from .sync import convert_sync

__version__ = "2.0.0"

__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync", "inplace_abn", "inplace_abn_sync", "use_backend", "HAS_NATIVE",
           "convert_sync", "fuse_for_inference", "FoldedABN", "convert_model", "AGN", "InPlaceAGN", "inplace_agn"]
