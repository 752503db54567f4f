"""launch.role's own logic (the roles themselves run in the e2e tests)."""

from __future__ import annotations

import numpy as np

from launch.role import _shard_images
from yatt.rl.data import Prompt


def test_a_controller_keeps_the_images_of_its_own_shards_prompts_only() -> None:
    pixels = {"pixel_values": np.ones((1, 3, 4, 4), dtype=np.float32)}
    prompts = [
        Prompt(index=i, prompt_ids=[1, 2], text="?", metadata={}, mm_inputs=dict(pixels), images=[b"png"]) for i in range(5)
    ]
    mine = _shard_images(prompts, shard=1, shards=2)
    assert [p.index for p in mine] == [0, 1, 2, 3, 4]  # (a key's prompt_index is its position)
    assert [bool(p.mm_inputs) for p in mine] == [False, True, False, True, False]
    assert [bool(p.images) for p in mine] == [False, True, False, True, False]
    assert all(p.prompt_ids == [1, 2] for p in mine)
