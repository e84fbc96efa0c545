"""Rendering the particle world, recording episodes and writing GIFs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from toy_env import MatchEnv

from mappo.envs import EnvError, EnvStep, make
from mappo.envs.rendering import random_actions, record_episode, save_gif

NAMES = ("mpe/simple_spread", "mpe/simple_speaker_listener", "mpe/simple_reference")


@pytest.mark.parametrize("name", NAMES)
def test_render_draws_the_chosen_env(name: str) -> None:
    env = make(name, num_envs=3)
    env.reset(seed=0)
    frames = [env.render(env_index=k, size=96) for k in range(3)]
    for frame in frames:
        assert frame.shape == (96, 96, 3) and frame.dtype == np.uint8
        assert (frame != 255).any(axis=-1).sum() > 50  # entities drawn on the white background
    # Different envs of the batch have different layouts.
    assert not np.array_equal(frames[0], frames[1])
    with pytest.raises(EnvError, match="env_index 3 is out of range"):
        env.render(env_index=3)


def test_render_shows_the_landmark_colours() -> None:
    env = make("mpe/simple_speaker_listener", num_envs=1)
    env.set_state({"agent_pos": torch.tensor([[[-0.5, -0.5], [0.5, 0.5]]])})
    frame = env.render(size=200).reshape(-1, 3).astype(int)
    for color in ((0.65, 0.15, 0.15), (0.15, 0.65, 0.15), (0.15, 0.15, 0.65)):
        rgb = np.round(255 * np.array(color))
        assert (np.abs(frame - rgb).max(-1) <= 1).any(), color


def test_record_episode_with_random_and_given_actions() -> None:
    env = make("mpe/simple_reference", num_envs=2)
    frames = record_episode(env, env_index=1, seed=3)
    # An episode of 25 steps: the start and the states before each later step.
    assert len(frames) == 25
    assert all(f.shape == (400, 400, 3) for f in frames)
    assert not np.array_equal(frames[0], frames[-1])

    calls = []

    def still(step: EnvStep) -> dict[str, torch.Tensor]:
        calls.append(step)
        return {"agents": torch.zeros(2, 2, 2, dtype=torch.int64)}

    frames = record_episode(env, act_fn=still, num_steps=4)
    assert len(frames) == 5 and len(calls) == 4
    # Nobody moves: every frame but the message text is the same picture.
    assert np.array_equal(frames[1][40:], frames[4][40:])


def test_random_actions_respect_masks() -> None:
    env = make("mpe/simple_reference", num_envs=64)
    mask = torch.zeros(64, 2, 15, dtype=torch.bool)
    mask[..., 3] = True  # move 3 only
    mask[..., 5 + 7] = True  # message 7 ...
    mask[..., 5 + 2] = True  # ... or message 2
    step = EnvStep({}, torch.empty(0), {}, torch.empty(0), torch.empty(0), {}, {"agents": mask})
    actions = random_actions(env, step, torch.Generator().manual_seed(0))["agents"]
    assert actions.shape == (64, 2, 2) and actions.dtype == torch.int64
    assert (actions[..., 0] == 3).all()
    assert set(actions[..., 1].unique().tolist()) == {2, 7}


def test_save_gif(tmp_path: Path) -> None:
    env = make("mpe/simple_spread", num_envs=1)
    frames = record_episode(env, num_steps=5)
    path = save_gif(frames, tmp_path / "sub" / "spread.gif", fps=5)
    with Image.open(path) as gif:
        assert gif.n_frames == len(frames) == 6
        assert gif.size == (400, 400)
        assert gif.info["duration"] == 200
    with pytest.raises(ValueError, match="at least one frame"):
        save_gif([], tmp_path / "empty.gif")
    with pytest.raises(ValueError, match=r"expected \[H, W, 3\] uint8"):
        save_gif([np.zeros((4, 4), dtype=np.uint8)], tmp_path / "bad.gif")


def test_an_interrupted_gif_write_leaves_the_file_that_was_there(tmp_path: Path, monkeypatch):
    frames = record_episode(make("mpe/simple_spread", num_envs=1), num_steps=2)
    path = save_gif(frames, tmp_path / "episode.gif")
    before = path.read_bytes()

    def interrupted(self, fp, *args, **kwargs):
        fp.write(b"GIF89a")  # the start of a file, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(Image.Image, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_gif(frames, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["episode.gif"]  # no partial file left


# -- envs that cannot render -------------------------------------------------------------------
class _RendersNothing(MatchEnv):
    """A toy env whose render returns ``None`` (as a Gymnasium env without a render mode does)."""

    def render(self, env_index: int = 0, size: int = 400) -> None:
        return None


class _RendersGrey(MatchEnv):
    """A toy env whose render returns a grey-scale ``[H, W]`` float image."""

    def render(self, env_index: int = 0, size: int = 400) -> np.ndarray:
        return np.zeros((size, size))


class _RefusesToRender(MatchEnv):
    def render(self, env_index: int = 0, size: int = 400) -> np.ndarray:
        raise NotImplementedError("no display list\nsecond line")


@pytest.mark.parametrize(
    ("env_class", "reason"),
    [
        (MatchEnv, "MatchEnv does not implement render()"),
        (_RendersNothing, "render() returned None"),
        (_RendersGrey, "render() returned shape (400, 400) and dtype float64, not [H, W, 3] uint8"),
        (_RefusesToRender, "no display list"),
    ],
)
def test_an_env_that_cannot_render_is_one_clear_error(env_class: type, reason: str) -> None:
    env = env_class(num_envs=2)
    with pytest.raises(EnvError) as info:
        record_episode(env, num_steps=3)
    assert str(info.value) == (
        f"environment 'toy/match' cannot render frames ({reason}); no GIF can be made of it "
        "(`mappo eval` evaluates it without one)"
    )


def test_an_adapter_env_cannot_render(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pettingzoo")
    from test_adapter_envs import tiny

    from mappo.cli import main
    from mappo.envs.adapters import PettingZooAdapter

    with PettingZooAdapter(tiny(), num_envs=1, num_workers=0, name="tiny") as env:
        with pytest.raises(EnvError, match=r"^environment 'tiny' cannot render frames \(the "):
            record_episode(env)
    # The CLI turns it into one line on stderr and exit status 2, and writes no GIF.
    gif = tmp_path / "tiny.gif"
    argv = ["render", "pettingzoo:test_adapter_envs:TinyEnv", "num_workers=0", "--gif", str(gif)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "mappo: error: environment 'pettingzoo:test_adapter_envs:TinyEnv' cannot render frames "
        "(the wrapped environment does not draw: its render() is not implemented); "
        "no GIF can be made of it (`mappo eval` evaluates it without one)\n"
    )
    assert not gif.exists()
