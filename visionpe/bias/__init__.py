"""Schemes that add to the attention logits.

One file per scheme; importing this package imports every scheme module, which registers it by name.
"""

import importlib as _importlib
import pkgutil as _pkgutil

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
