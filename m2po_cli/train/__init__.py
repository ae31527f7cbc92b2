"""`m2po train`: the loop, its two rollout sources, the packed rollouts, the staleness FIFO, the run log."""
