"""Counts what each process of a documented command trains, without changing the command.

``tests/test_docs_launch.py`` runs the docs' commands verbatim with this directory on
``PYTHONPATH`` and ``TOKENBATCH_COUNT_ROWS`` set to a directory: Python imports this file
at start-up in every process. It wraps ``torch.nn.Module.__call__`` so that each call of
an outermost module (the model, or the DDP wrapper around it) with a 2-D ``input_ids``
tensor, with gradients enabled (training, not evaluation), records each row's token ids
(those the ``attention_mask`` keeps). At exit each process writes its rows to
``<dir>/<pid>.json``, with its ``RANK`` and the exception that ended it, if one did
(``"error"``: ``"Type: message"``). Rows identify samples: the tests' texts are
distinct, so each sample's row is its own.
"""

from __future__ import annotations

import os

if os.environ.get("TOKENBATCH_COUNT_ROWS"):
    import atexit
    import json
    import sys
    import threading
    from pathlib import Path
    from typing import Any

    import torch

    _rows: list[list[int]] = []
    _error: list[str] = []
    _excepthook = sys.excepthook

    def _record_error(kind: Any, error: Any, traceback: Any) -> None:
        _error.append(f"{kind.__name__}: {error}")
        _excepthook(kind, error, traceback)

    sys.excepthook = _record_error
    _depth = threading.local()
    _call = torch.nn.Module.__call__

    def _counting_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "value", 0)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if depth == 0 and torch.is_grad_enabled() and isinstance(ids, torch.Tensor) and ids.dim() == 2:
            mask = kwargs.get("attention_mask")
            for i, row in enumerate(ids.tolist()):
                keep = mask[i].tolist() if isinstance(mask, torch.Tensor) else [1] * len(row)
                _rows.append([token for token, kept in zip(row, keep, strict=True) if kept])
        _depth.value = depth + 1
        try:
            return _call(self, *args, **kwargs)
        finally:
            _depth.value = depth

    torch.nn.Module.__call__ = _counting_call  # type: ignore[method-assign]

    @atexit.register
    def _write() -> None:
        out = Path(os.environ["TOKENBATCH_COUNT_ROWS"]) / f"{os.getpid()}.json"
        record = {"rank": os.environ.get("RANK"), "rows": _rows, "error": _error[0] if _error else None}
        out.write_text(json.dumps(record))
