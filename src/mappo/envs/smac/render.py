"""Drawing a battle of :class:`~mappo.envs.smac.env.SMACEnv` with Pillow (no display needed).

Allies are blue, enemies red; each live unit is a circle of its true radius with its type letter,
a health bar (green) and, for Protoss units, a shield bar (cyan) above it. A line joins every
unit that fired in the last step to its target (orange for allies, red for enemies, green for a
medivac's heal); dead units are grey crosses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw, ImageFont

if TYPE_CHECKING:
    from mappo.envs.smac.env import SMACEnv

BACKGROUND = (36, 44, 38)
GRID = (48, 58, 50)
ALLY = (70, 130, 235)
ENEMY = (220, 70, 60)
DEAD = (110, 110, 110)
ALLY_SHOT = (255, 190, 60)
ENEMY_SHOT = (255, 90, 90)
HEAL = (90, 230, 110)
HEALTH = (70, 210, 80)
SHIELD = (80, 220, 240)
BAR_BACK = (20, 20, 20)


def render_battle(env: SMACEnv, env_index: int = 0, size: int = 400) -> np.ndarray:
    """An RGB frame ``[size, size, 3]`` uint8 of battle ``env_index`` of ``env``."""
    if not 0 <= env_index < env.num_envs:
        raise IndexError(f"{env.name}: env_index {env_index} is not in [0, {env.num_envs})")
    state = {k: v[env_index].detach().cpu().numpy() for k, v in env.get_state().items()}
    width, height = env.map.size
    scale = size / max(width, height)

    def px(x: float, y: float) -> tuple[float, float]:
        # Map y grows north, image rows grow downward.
        return x * scale, size - y * scale

    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for g in range(0, int(max(width, height)) + 1, 4):
        draw.line([px(g, 0), px(g, height)], fill=GRID)
        draw.line([px(0, g), px(width, g)], fill=GRID)

    n = env.n_agents
    pos, health, shield = state["pos"], state["health"], state["shield"]
    for u, unit in enumerate(env.units):
        t = int(state["target"][u])
        if not state["fired"][u] or t < 0:
            continue
        colour = HEAL if unit.healer else (ALLY_SHOT if u < n else ENEMY_SHOT)
        draw.line([px(*pos[u]), px(*pos[t])], fill=colour, width=max(1, size // 300))

    font = ImageFont.load_default()
    bar_w = max(6.0, 1.6 * scale)
    bar_h = max(2.0, size / 200)
    for u, unit in enumerate(env.units):
        cx, cy = px(*pos[u])
        r = max(2.0, unit.radius * scale)
        if health[u] <= 0:
            draw.line([(cx - r, cy - r), (cx + r, cy + r)], fill=DEAD, width=1)
            draw.line([(cx - r, cy + r), (cx + r, cy - r)], fill=DEAD, width=1)
            continue
        colour = ALLY if u < n else ENEMY
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour, outline=(230, 230, 230))
        draw.text((cx, cy), unit.letter, fill=(255, 255, 255), font=font, anchor="mm")
        bars = [(health[u] / unit.health, HEALTH)]
        if unit.shield > 0:
            bars.append((shield[u] / unit.shield, SHIELD))
        for k, (frac, fill) in enumerate(bars):
            top = cy - r - (k + 1) * (bar_h + 1) - 1
            left = cx - bar_w / 2
            draw.rectangle([left, top, left + bar_w, top + bar_h], fill=BAR_BACK)
            draw.rectangle([left, top, left + bar_w * float(frac), top + bar_h], fill=fill)

    draw.text((4, 4), f"{env.map.name}  t={int(state['t'])}", fill=(230, 230, 230), font=font)
    return np.asarray(image, dtype=np.uint8)
