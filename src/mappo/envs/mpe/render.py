"""Drawing one particle world with Pillow (no display needed)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw

from mappo.envs.base import EnvError

Color = tuple[float, float, float]

BACKGROUND = (255, 255, 255)


def _rgb(color: Color) -> tuple[int, int, int]:
    r, g, b = (int(round(255 * min(max(c, 0.0), 1.0))) for c in color)
    return r, g, b


def draw_world(
    agent_pos: np.ndarray,
    agent_size: Sequence[float],
    agent_colors: Sequence[Color],
    landmark_pos: np.ndarray,
    landmark_size: Sequence[float],
    landmark_colors: Sequence[Color],
    lines: Sequence[str] = (),
    size: int = 400,
) -> np.ndarray:
    """An RGB frame ``[size, size, 3]`` uint8 of one world.

    ``agent_pos`` ``[N, 2]`` and ``landmark_pos`` ``[L, 2]`` are world coordinates; the view
    spans ``[-r, r]^2`` with ``r`` the larger of 1 and the farthest entity's edge (as the MPE
    viewer zooms out to keep every entity in sight), +y up. Landmarks are drawn first and agents
    on top with a dark outline; ``lines`` (messages, goals) are written in the top-left corner.
    """
    if not isinstance(size, int) or size < 16:
        raise EnvError(f"render size must be an integer >= 16 pixels, got {size!r}")
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    reach = [np.abs(p).max(initial=0.0) + r for p, r in zip(agent_pos, agent_size, strict=True)]
    reach += [
        np.abs(p).max(initial=0.0) + r for p, r in zip(landmark_pos, landmark_size, strict=True)
    ]
    extent = max([1.0, *reach]) * 1.05
    scale = size / (2.0 * extent)

    def circle(pos: np.ndarray, radius: float, color: Color, outline: bool) -> None:
        x = (float(pos[0]) + extent) * scale
        y = (extent - float(pos[1])) * scale
        r = max(radius * scale, 2.0)
        edge = (40, 40, 40) if outline else None
        draw.ellipse((x - r, y - r, x + r, y + r), fill=_rgb(color), outline=edge)

    for pos, radius, color in zip(landmark_pos, landmark_size, landmark_colors, strict=True):
        circle(pos, radius, color, outline=False)
    for pos, radius, color in zip(agent_pos, agent_size, agent_colors, strict=True):
        circle(pos, radius, color, outline=True)
    for row, text in enumerate(lines):
        draw.text((4, 4 + 12 * row), text, fill=(0, 0, 0))
    return np.asarray(image, dtype=np.uint8).copy()
