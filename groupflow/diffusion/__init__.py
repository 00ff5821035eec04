"""GRPO for diffusion / flow-matching generators (Flow-GRPO, DanceGRPO) in the same driver.

Design decision: a flow-matching generator is one more policy type. Its actions are the denoising
steps of an SDE sampler, each with a Gaussian log-prob averaged over the latent, so advantages,
the PPO-clip loss, aggregation, checkpoints and the trainer loop are the LLM's; this package adds
only what is specific: the sigma schedule and samplers (``samplers``), the models (``models``),
image/video rewards (``rewards``), the worker (``worker``), the driver-side policy object
(``policy``) and pre-training of the tiny demo model (``pretrain``). Math: algorithms.md §7.
"""
