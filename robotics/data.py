"""Robot episodes: compact storage (one compressed ``.npz``) and LeRobot dataset format v3.0 import/export.

An episode holds, per control step t: the camera frame(s) *before* the action (``images[t]``, uint8 HWC),
proprioception, the full 39-d Meta-World state, the action, and the success flag *after* the action, plus the
task name and instruction. A dataset file stores all episodes concatenated with ``episode_starts``.

LeRobot v3.0 (``meta/info.json``, ``meta/tasks.parquet``, ``meta/episodes/…``, ``data/chunk-000/file-000.parquet``,
images embedded as PNG): ``export_lerobot`` writes through the real ``lerobot`` package
(``LeRobotDataset.create`` / ``add_frame`` / ``save_episode`` / ``finalize``), which is optional —
``pip install --no-deps -c constraints.txt lerobot av`` (LeRobot 0.6.1, Python >= 3.12; its own pins ask for
torch < 2.12, its dataset module works without them; ``make`` installs it). ``import_lerobot`` reads the v3.0 files with pyarrow
only, so importing works without lerobot. The reset-state key of each episode (which Meta-World reset produced it:
what BC and RL use to keep demonstrations, training and evaluation states apart) has no LeRobot feature that
survives its scalar encoding, so it travels in ``meta/grove.json`` (``{"reset_keys": [...]}``, one per episode),
a file LeRobot itself ignores.

Problems with the user's files (missing, not an episodes file, not a LeRobot dataset) raise ``ConfigError`` with
one line, which ``grove robotics ...`` prints with exit code 2.
"""
from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared_rl.errors import ConfigError

METAWORLD_FPS = 80  # frame_skip 5 x timestep 0.0025 s
LIBERO_FPS = 20  # LIBERO's control frequency (robosuite control_freq)


@dataclass
class Episode:
    task: str
    instruction: str
    images: np.ndarray  # [T, H, W, C] uint8
    proprio: np.ndarray  # [T, P] float32
    actions: np.ndarray  # [T, A] float32
    success: np.ndarray  # [T] bool, after each action
    states: np.ndarray | None = None  # [T, 39] float32
    key: int = -1

    def __len__(self) -> int:
        return int(self.actions.shape[0])

    @property
    def succeeded(self) -> bool:
        return bool(self.success.any())


def save_episodes(episodes: list[Episode], path: str | Path) -> Path:
    """Write episodes to one compressed ``.npz`` (images compress ~5x: flat backgrounds)."""
    if not episodes:
        raise ConfigError("no episodes to save")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = np.array([len(e) for e in episodes], np.int64)
    arrays = {
        "episode_starts": np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
        "episode_lengths": lengths,
        "images": np.concatenate([e.images for e in episodes]),
        "proprio": np.concatenate([e.proprio for e in episodes]).astype(np.float32),
        "actions": np.concatenate([e.actions for e in episodes]).astype(np.float32),
        "success": np.concatenate([e.success for e in episodes]).astype(bool),
        "keys": np.array([e.key for e in episodes], np.int64),
        "tasks": np.array([e.task for e in episodes]),
        "instructions": np.array([e.instruction for e in episodes]),
    }
    if all(e.states is not None for e in episodes):
        arrays["states"] = np.concatenate([e.states for e in episodes]).astype(np.float32)
    np.savez_compressed(path, **arrays)
    return path


EPISODE_ARRAYS = ("episode_starts", "episode_lengths", "images", "proprio", "actions", "success", "keys", "tasks",
                  "instructions")


def _check_episode_arrays(d: dict[str, np.ndarray], where: str) -> None:
    """The arrays of an episodes file agree with each other (one line naming what does not): per-episode arrays of
    one length, episodes that tile the frames, frames of one length, uint8 images, numeric vectors."""
    n = len(d["episode_starts"])
    bad = [k for k in ("episode_lengths", "tasks", "instructions", "keys") if len(d[k]) != n]
    frames = len(d["actions"])
    bad += [k for k in ("images", "proprio", "success") + (("states",) if "states" in d else ()) if len(d[k]) != frames]
    if bad:
        raise ConfigError(f"{where!r}: arrays of different lengths ({', '.join(bad)} disagree with "
                          f"episode_starts {n} / actions {frames}); the file is damaged: collect it again")
    starts, lengths = d["episode_starts"].astype(np.int64), d["episode_lengths"].astype(np.int64)
    expected = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if n else starts
    if (lengths < 1).any() or not np.array_equal(starts, expected) or int(lengths.sum()) != frames:
        raise ConfigError(f"{where!r}: episode_starts / episode_lengths do not tile its {frames} frames; the file is "
                          f"damaged: collect it again")
    if d["images"].dtype != np.uint8 or d["images"].ndim != 4:
        raise ConfigError(f"{where!r}: images must be uint8 [frames, H, W, channels], got {d['images'].dtype} "
                          f"{list(d['images'].shape)}")
    for k in ("proprio", "actions"):
        if d[k].dtype.kind not in "fiu" or d[k].ndim != 2:
            raise ConfigError(f"{where!r}: {k} must be a numeric [frames, dims] array, got {d[k].dtype} "
                              f"{list(d[k].shape)}")


def load_episodes(path: str | Path) -> list[Episode]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"episode file {str(path)!r} does not exist (make one with `grove robotics collect`)")
    try:
        with np.load(path, allow_pickle=False) as z:
            d = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # not a zip / truncated / pickled objects
        raise ConfigError(f"{str(path)!r} is not an episodes .npz written by `grove robotics collect` (not a "
                          f"NumPy .npz archive: {type(e).__name__})") from None
    missing = sorted(set(EPISODE_ARRAYS) - set(d))
    if missing:
        raise ConfigError(f"{str(path)!r} is not an episodes .npz written by `grove robotics collect` (it lacks "
                          f"{', '.join(missing)})")
    _check_episode_arrays(d, str(path))
    out = []
    for i, (s, n) in enumerate(zip(d["episode_starts"], d["episode_lengths"])):
        sl = slice(int(s), int(s + n))
        out.append(Episode(
            task=str(d["tasks"][i]), instruction=str(d["instructions"][i]), images=d["images"][sl],
            proprio=d["proprio"][sl], actions=d["actions"][sl], success=d["success"][sl],
            states=d["states"][sl] if "states" in d else None, key=int(d["keys"][i]),
        ))
    return out


# -------------------------------------------------------------------------------------------------------------
# LeRobot v3.0

IMAGE_KEY = "observation.image"
GROVE_META = "grove.json"  # meta/grove.json: what LeRobot's features do not carry (reset-state keys)


def _image_keys(ep: Episode, cameras: list[str] | None) -> list[str]:
    """One LeRobot image feature per camera: ``observation.image`` for a single camera (grove's Meta-World export),
    ``observation.images.<camera>`` for several (LIBERO: image, image2, as LeRobot's LIBERO datasets name them)."""
    c = ep.images.shape[-1]
    if cameras and len(cameras) > 1:
        if c != 3 * len(cameras):
            raise ValueError(f"{len(cameras)} cameras need {3 * len(cameras)} image channels; the episodes have {c}")
        return [f"observation.images.{cam}" for cam in cameras]
    if c != 3:
        raise ValueError(f"LeRobot image features are RGB; this dataset has {c} channels (name its cameras)")
    return [IMAGE_KEY]


def _lerobot_features(ep: Episode, cameras: list[str] | None = None) -> dict:
    h, w = ep.images.shape[1:3]
    feats = {
        **{key: {"dtype": "image", "shape": (h, w, 3), "names": ["height", "width", "channels"]}
           for key in _image_keys(ep, cameras)},
        "observation.state": {"dtype": "float32", "shape": (ep.proprio.shape[1],), "names": None},
        "action": {"dtype": "float32", "shape": (ep.actions.shape[1],), "names": None},
        "next.success": {"dtype": "bool", "shape": (1,), "names": None},
    }
    if ep.states is not None:
        feats["observation.environment_state"] = {"dtype": "float32", "shape": (ep.states.shape[1],), "names": None}
    return feats


def export_lerobot(episodes: list[Episode], root: str | Path, repo_id: str = "grove/metaworld", fps: int = METAWORLD_FPS,
                   cameras: list[str] | None = None) -> Path:
    """Write a LeRobot v3.0 dataset at ``root`` (must not exist) with the real ``lerobot`` package.

    The task string of each frame is the instruction (LeRobot's ``task`` is the language annotation). ``cameras``
    names the cameras stacked on the episodes' channel axis when there are several (one feature each).
    """
    LeRobotDataset = lerobot_dataset_class()
    root = Path(root)
    if root.exists():
        raise ConfigError(f"{root} exists; LeRobot creates the dataset directory itself: remove it or choose another")
    if not episodes:
        raise ConfigError("no episodes to export")
    ds = LeRobotDataset.create(repo_id, fps=fps, root=root, features=_lerobot_features(episodes[0], cameras),
                               use_videos=False, image_writer_threads=0)
    image_keys = _image_keys(episodes[0], cameras)
    for ep in episodes:
        for t in range(len(ep)):
            frame = {
                **{key: ep.images[t][..., 3 * i: 3 * i + 3] for i, key in enumerate(image_keys)},
                "observation.state": ep.proprio[t].astype(np.float32),
                "action": ep.actions[t].astype(np.float32),
                "next.success": np.array([bool(ep.success[t])]),
                "task": ep.instruction,
            }
            if ep.states is not None:
                frame["observation.environment_state"] = ep.states[t].astype(np.float32)
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()
    (root / "meta" / GROVE_META).write_text(json.dumps({"reset_keys": [int(ep.key) for ep in episodes]}) + "\n")
    return root


def check_new_dataset_dir(path: str | Path, flag: str) -> None:
    """A LeRobot dataset directory to be created: it must not exist and its folder must be writable."""
    from shared_rl.cli import check_output_dir

    if not str(path).strip():
        raise ConfigError(f"{flag} is empty; give the new dataset's directory")
    if Path(path).exists():
        raise ConfigError(f"{flag} {str(path)!r} exists; LeRobot creates the dataset directory itself: remove it or "
                          f"choose another")
    check_output_dir(Path(path).parent, flag=flag)


def lerobot_dataset_class():
    """``LeRobotDataset``, or a ConfigError saying how to install it (checked before any work is done)."""
    try:
        from lerobot.datasets.lerobot_dataset import LeRobotDataset
    except ImportError as e:
        raise ConfigError(f"LeRobot export needs the lerobot dataset module ({e}); install it with `pip install "
                          f"--no-deps -c constraints.txt lerobot av` (LeRobot 0.6, Python >= 3.12; make does this)") from None
    return LeRobotDataset


def _decode_image(cell) -> np.ndarray:
    from PIL import Image

    if isinstance(cell, dict):
        data = cell.get("bytes")
        if data is None and cell.get("path"):
            return np.asarray(Image.open(cell["path"]).convert("RGB"))
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    raise ValueError(f"cannot decode an image cell of type {type(cell).__name__}")


def import_lerobot(root: str | Path, image_key: str | None = None, task_names: dict[str, str] | None = None) -> list[Episode]:
    """Read a LeRobot v3.0 dataset (image features; video features need torchcodec/FFmpeg and are rejected).

    ``task_names`` maps instruction text -> task name (default: the text of the instruction, or the Meta-World
    task whose instruction it is).
    """
    from shared_rl.readers import read_json, read_parquet

    from .envs.metaworld_env import TASK_INSTRUCTIONS

    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"LeRobot dataset {str(root)!r} does not exist (give the dataset's root directory)")
    info_path = root / "meta" / "info.json"
    if not info_path.is_file():
        raise ConfigError(f"{str(root)!r} is not a LeRobot dataset (no meta/info.json)")
    info = read_json(info_path, "LeRobot's dataset metadata (meta/info.json, UTF-8 JSON)")
    if not isinstance(info, dict) or not str(info.get("codebase_version", "")).startswith("v3"):
        version = info.get("codebase_version") if isinstance(info, dict) else None
        raise ConfigError(f"{root}: LeRobot format {version!r}; only v3.x is supported")
    feats = info.get("features") or {}
    if not isinstance(feats, dict) or not all(isinstance(f, dict) for f in feats.values()):
        raise ConfigError(f"{info_path}: 'features' must map each feature name to its description (dtype, shape)")
    for need in ("observation.state", "action"):
        if need not in feats:
            raise ConfigError(f"{root}: the dataset has no {need!r} feature (features: {sorted(feats)})")
    image_keys = [k for k, f in feats.items() if f.get("dtype") in ("image", "video")]
    if image_key:
        read_keys = [image_key]
    elif IMAGE_KEY in feats:
        read_keys = [IMAGE_KEY]
    else:  # several cameras (observation.images.*): stacked on the channel axis in the dataset's feature order
        read_keys = image_keys
    if not read_keys or any(k not in feats for k in read_keys):
        raise ConfigError(f"{root}: no image feature {image_key or ''} (features: {sorted(feats)})")
    for key in read_keys:
        if feats[key].get("dtype") == "video":
            raise ConfigError(f"{root}: {key!r} is stored as video; decode it with lerobot (needs torchcodec/FFmpeg)")
    if not (root / "meta" / "tasks.parquet").is_file():
        raise ConfigError(f"{root}: no meta/tasks.parquet (an unfinished or non-v3 dataset?)")
    tasks_table = read_parquet(root / "meta" / "tasks.parquet", "LeRobot's task table (meta/tasks.parquet)",
                               ["task_index"]).to_pandas()
    # tasks.parquet is indexed by the task string with a task_index column
    index_to_task = {int(r["task_index"]): str(name) for name, r in tasks_table.iterrows()}
    if "task" in tasks_table.columns:  # tolerate a flat layout too
        index_to_task = {int(r["task_index"]): str(r["task"]) for _, r in tasks_table.iterrows()}
    by_text = {v: k for k, v in TASK_INSTRUCTIONS.items()}
    by_text.update(task_names or {})
    files = sorted((root / "data").glob("chunk-*/file-*.parquet"))
    if not files:
        raise ConfigError(f"{root}: no data/chunk-*/file-*.parquet files (an unfinished or non-v3 dataset?)")
    import pandas as pd

    state_key = "observation.state"
    columns = ["episode_index", "frame_index", "task_index", state_key, "action", *read_keys]
    df = pd.concat([read_parquet(f, "a LeRobot data file (frames of episodes)", columns).to_pandas() for f in files],
                   ignore_index=True)
    df = df.sort_values(["episode_index", "frame_index"])
    meta_path = root / "meta" / GROVE_META
    meta = read_json(meta_path, "grove's reset-state keys ({\"reset_keys\": [...]})") if meta_path.is_file() else {}
    keys = meta.get("reset_keys", []) if isinstance(meta, dict) else []
    episodes = []
    for index, g in df.groupby("episode_index", sort=True):
        try:
            text = index_to_task[int(g["task_index"].iloc[0])]
            episodes.append(Episode(
                task=by_text.get(text, text),
                instruction=text,
                images=np.concatenate([np.stack([_decode_image(c) for c in g[key]]) for key in read_keys], axis=-1),
                proprio=np.stack(g[state_key].to_numpy()).astype(np.float32),
                actions=np.stack(g["action"].to_numpy()).astype(np.float32),
                success=(np.stack(g["next.success"].to_numpy()).reshape(-1).astype(bool) if "next.success" in g
                         else np.zeros(len(g), bool)),
                states=(np.stack(g["observation.environment_state"].to_numpy()).astype(np.float32)
                        if "observation.environment_state" in g else None),
                key=int(keys[len(episodes)]) if len(episodes) < len(keys) else -1,
            ))
        except KeyError as e:
            raise ConfigError(f"{root}: episode {index} names task_index {e} that meta/tasks.parquet does not "
                              f"list") from None
        except (ValueError, TypeError, OSError) as e:  # ragged rows, undecodable images, non-numeric cells
            raise ConfigError(f"{root}: episode {index} cannot be read ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else ''}); re-export the dataset") from None
    return episodes
