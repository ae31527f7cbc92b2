"""The learner: the policy on its FSDP2 mesh (`policy.Learner`, placed by `parallelize`), its
micro-batches, a group's prompt computed once for its responses, response-token logprobs, and M2PO's
mask corrected from the training forwards."""
