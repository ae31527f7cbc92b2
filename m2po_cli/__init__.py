"""m2po: off-policy RL of LLMs on stale rollouts (M2PO, GRPO and baselines)."""

import os

# PyTorch's CPU allocator backs every allocation of 2 MiB or more with transparent huge pages
# (madvise): a training step allocates and frees its activations, gradients and FSDP buffers anew,
# and on 4 KiB pages the kernel faults each one in page by page (~30% of a CPU update's time at
# 135M). Read once, at torch's first allocation, so it is set before anything imports torch; an
# explicit THP_MEM_ALLOC_ENABLE=0 in the environment wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
