"""A reward on a wide scale for examples/diffusion_two_rewards.yaml: the demo's sky-colour score
times 100, standing in for a model-based scorer such as PickScore (100 · cos(image, text), whose
samples of one prompt differ by whole units) next to a reward in [0, 1].

Design decision: a plain function by import path, as any user reward; it reuses the built-in
``target_color`` so that only the scale differs from the demo's reward.
"""

from groupflow.diffusion.rewards import make_target_color_reward

_SKY = make_target_color_reward(color=(0.2, 0.8, 1.0))


def sky_x100(completions):
    return [100.0 * v for v in _SKY(completions)]
