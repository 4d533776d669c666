"""Token-budget batches from a stream of examples: :class:`TokenBudgetStream`.

For data whose lengths are not known up front (``datasets`` streaming, a
function that returns a new generator each epoch, webdataset shards).
Memory stays O(``buffer_size``): each reader (a rank, or a DataLoader
worker of it) holds that many examples in length order and draws batches
from them (with a packed ``CostModel``: packs of whole examples, a full
buffer packed at once); on several ranks the readers agree at each step, so
that every rank yields the same number of batches.

Inside the package:

- ``_dataset``: :class:`TokenBudgetStream`, the ``IterableDataset`` users hold:
  its options, the budget and epoch it shares with DataLoader workers, and
  its checkpoint (``state_dict`` / ``load_state_dict``);
- ``_run``: one reader's pass over its part (read, batch, final round,
  resume) and the agreement between ranks, with the places it is refused;
- ``_buffer``: the length-ordered buffer a batch is drawn from;
- ``_source``: who reads what: the reader, its part of the examples, and
  how a resume gets back to a position.
"""

from tokenbatch.stream._dataset import TokenBudgetStream

__all__ = ["TokenBudgetStream"]
