"""Evaluation GIFs play at the env's real speed: imageio reads the frame duration in milliseconds (a duration in
seconds, 0.1, was written as no delay at all), and a clip faster than a browser plays (delays under 20 ms run at
100 ms) keeps every n-th frame instead."""
import numpy as np
from PIL import Image

from robotics.episodes import write_gif


def _written(path):
    im = Image.open(path)
    durations = []
    for i in range(im.n_frames):
        im.seek(i)
        durations.append(im.info["duration"])
    return durations


def test_gif_frames_last_their_real_time(tmp_path):
    frames = [np.full((8, 8, 3), 20 * i, np.uint8) for i in range(12)]
    write_gif(frames, tmp_path / "a.gif", fps=20)  # one frame per 4-step chunk at 80 Hz: 50 ms each
    assert _written(tmp_path / "a.gif") == [50] * 12
    write_gif(frames, tmp_path / "b.gif", fps=80)  # 12.5 ms a frame: every other frame, at 20-30 ms
    durations = _written(tmp_path / "b.gif")
    assert len(durations) == 6 and all(d >= 20 for d in durations)
    assert abs(sum(durations) - 12 * 12.5) <= 0.25 * 12 * 12.5  # about the clip's real length
