"""Megatron tensor parallelism for any module: split layers, vocab-parallel loss, plans.

`tensor_parallel(module, mesh, axis, plan)` gives this rank's copy of a model under a plan of
styles; `gpt_plan` and `llama_plan` are the shipped plans; `vocab_parallel_cross_entropy` is
the loss over vocab-split logits; `tensor_parallel_optimizer` takes a non-pointwise optimizer's
statistics (norms, clipping, factored moments) over the whole tensors.
"""

from fscale.parallel.tensor.apply import SPLITS_ATTR as SPLITS_ATTR
from fscale.parallel.tensor.apply import shard_like as shard_like
from fscale.parallel.tensor.apply import shard_tensor as shard_tensor
from fscale.parallel.tensor.apply import tensor_parallel as tensor_parallel
from fscale.parallel.tensor.dropout import TensorParallelDropout as TensorParallelDropout
from fscale.parallel.tensor.layers import ColumnParallelLinear as ColumnParallelLinear
from fscale.parallel.tensor.layers import RowParallelLinear as RowParallelLinear
from fscale.parallel.tensor.layers import TensorAxis as TensorAxis
from fscale.parallel.tensor.layers import VocabParallelEmbedding as VocabParallelEmbedding
from fscale.parallel.tensor.loss import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from fscale.parallel.tensor.optimizer import tensor_parallel_optimizer as tensor_parallel_optimizer
from fscale.parallel.tensor.plans import gpt_plan as gpt_plan
from fscale.parallel.tensor.plans import llama_plan as llama_plan
from fscale.parallel.tensor.regions import all_reduce_max as all_reduce_max
from fscale.parallel.tensor.regions import gather_replicated as gather_replicated
from fscale.parallel.tensor.regions import split_replicated as split_replicated
from fscale.parallel.tensor.styles import Colwise as Colwise
from fscale.parallel.tensor.styles import Heads as Heads
from fscale.parallel.tensor.styles import Input as Input
from fscale.parallel.tensor.styles import Output as Output
from fscale.parallel.tensor.styles import Replicate as Replicate
from fscale.parallel.tensor.styles import Rowwise as Rowwise
from fscale.parallel.tensor.styles import Sequence as Sequence
from fscale.parallel.tensor.styles import Split as Split
from fscale.parallel.tensor.styles import Style as Style
from fscale.parallel.tensor.styles import Vocab as Vocab
