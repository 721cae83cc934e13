"""Loading a user's LeRobot policy for grove (``robotics.policy: {type: lerobot, path: ...}``) and checking that the
env can feed it: every problem is one ``ConfigError`` line (the CLI's exit 2) before the weights load."""
from __future__ import annotations

import json
from pathlib import Path

from shared_rl.errors import ConfigError
from shared_rl.readers import read_json

from .compat import FAMILIES, import_policies, policy_class
from .settings import PolicySettings

PROCESSOR_FILES = ("policy_preprocessor.json", "policy_postprocessor.json")


def read_policy_config(path: str, env_kind: str = "metaworld") -> dict:
    """The policy's ``config.json`` (a local directory, or a hub id resolved in the local cache only); also what
    ``RoboticsConfig.preflight`` reads, so ``--dry-run`` refuses a missing or uncached policy as the run does."""
    from shared_rl.prechecks import check_lerobot_policy

    # a missing local path, a directory without config.json, an uncached hub id: the CLI's early line ("did you
    # mean" included), so the Python API and the CLI say the same
    check_lerobot_policy(path, env_kind, "lerobot")
    p = Path(path)
    if p.is_dir():
        config = read_json(p / "config.json", "a LeRobot policy config (policy.save_pretrained writes it)")
        if not isinstance(config, dict):
            raise ConfigError(f"robotics.policy.path: {p / 'config.json'} is not a JSON object; it should be a LeRobot "
                              f"policy config")
        return config
    from huggingface_hub import hf_hub_download

    try:
        return json.loads(Path(hf_hub_download(path, "config.json", local_files_only=True)).read_text())
    except Exception:  # not a directory and not in the hub cache (no network here: offline by design)
        raise ConfigError(f"robotics.policy.path: {path!r} is neither a LeRobot policy directory nor a hub id in the "
                          f"local cache (download it once with `hf download {path}`)") from None


def _camera_by_name(key: str, cameras: list[str]) -> str | None:
    """``observation.images.<camera>`` is that env camera; LeRobot's single-camera ``observation.image`` (grove's
    own LeRobot export) is the env's camera when it has one."""
    name = key.removeprefix("observation.images.")
    if name in cameras:
        return name
    return cameras[0] if key == "observation.image" and len(cameras) == 1 else None


def feature_map(config: dict, env_cfg, settings: PolicySettings) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """Which env camera feeds each image feature of the policy, and each feature's resolution; one line per
    feature the env cannot provide."""
    inputs, outputs = config.get("input_features", {}), config.get("output_features", {})
    for cam_key, cam in settings.cameras.items():
        if cam not in env_cfg.cameras:
            raise ConfigError(f"robotics.policy.cameras: {cam_key} -> {cam!r}, but robotics.env.cameras are "
                              f"{env_cfg.cameras}")
        if cam_key not in inputs or inputs[cam_key]["type"] != "VISUAL":
            raise ConfigError(f"robotics.policy.cameras: {cam_key!r} is not an image feature of the policy "
                              f"({sorted(k for k, f in inputs.items() if f['type'] == 'VISUAL')})")
    cameras, sizes = {}, {}
    for key, feat in inputs.items():
        kind = feat["type"]
        if kind == "VISUAL":
            if key.startswith("observation.images.empty_camera_"):
                continue  # SmolVLA / π0 fill their padding cameras themselves
            cam = settings.cameras.get(key) or _camera_by_name(key, env_cfg.cameras)
            if cam is None:
                raise ConfigError(f"robotics.policy: the policy's image feature {key!r} has no env camera (env.cameras "
                                  f"{env_cfg.cameras}); map it: robotics.policy.cameras: {{{key}: {env_cfg.cameras[0]}}}")
            cameras[key], sizes[key] = env_cfg.cameras.index(cam), tuple(feat["shape"][-2:])
        elif kind == "ENV" and config.get("type") in FAMILIES:
            continue  # declared by a dataset with an environment state, never read by SmolVLA / π (images, state, text)
        elif key == "observation.state":
            if feat["shape"][0] != env_cfg.proprio_dim:
                raise ConfigError(f"robotics.policy: the policy's observation.state has {feat['shape'][0]} dims, the env's "
                                  f"proprio {env_cfg.proprio_dim} (include_goal={env_cfg.include_goal}, "
                                  f"include_object={env_cfg.include_object})")
        else:
            raise ConfigError(f"robotics.policy: the policy reads {key!r} ({kind}), which the env cannot provide "
                              f"(it gives camera images, observation.state and the task's instruction)")
    if not cameras:
        raise ConfigError("robotics.policy: the policy declares no image feature the env can feed")
    action = outputs.get("action")
    need = env_cfg.action_dim
    if action is None or action["shape"][0] < need:
        what = "LIBERO: OSC_POSE delta + gripper" if env_cfg.kind == "libero" else "Meta-World: hand xyz + gripper"
        raise ConfigError(f"robotics.policy: the policy's action feature {action} must have >= {need} dims ({what}; "
                          f"a longer action is cut to its first {need})")
    return cameras, sizes


def load_lerobot_policy(settings: PolicySettings, env_cfg, path: str, seed: int, env_action_dim: int = 4,
                        noise_head: bool = False):
    """The LeRobot policy at ``path`` (``settings.path`` resolved by the caller) as a :class:`LeRobotVLA`; with
    ``noise_head`` the learned std of ``flow_noise`` (``settings.noise``)."""
    config = read_policy_config(path, env_cfg.kind)
    family = config.get("type")
    if family not in FAMILIES:
        raise ConfigError(f"robotics.policy.path: {path} holds a LeRobot {family!r} policy; grove drives "
                          f"{', '.join(FAMILIES)}")
    if config.get("adapt_to_pi_aloha"):
        raise ConfigError("robotics.policy: adapt_to_pi_aloha converts Aloha joint spaces; a Meta-World policy has it off")
    cameras, sizes = feature_map(config, env_cfg, settings)
    k = settings.n_action_steps or config["n_action_steps"]
    if k > config["chunk_size"]:
        raise ConfigError(f"robotics.policy.n_action_steps {k} exceeds the policy's chunk_size {config['chunk_size']}")
    if Path(path).is_dir() and not all((Path(path) / f).is_file() for f in PROCESSOR_FILES):
        raise ConfigError(f"robotics.policy.path: {path} lacks LeRobot's processors ({', '.join(PROCESSOR_FILES)}: "
                          f"normalisation stats and tokenizer); save them with preprocessor.save_pretrained(dir)")

    import_policies()
    from lerobot.policies.factory import make_pre_post_processors

    from .adapter import LeRobotVLA

    from .tiny_pi import read_tiny, sizes_context

    from .local_files import policy_config_here, preprocessor_overrides_here

    # inside shared_rl.sharding.meta_unless_rank0 (robotics.fsdp.load_policy_on_rank0: processes > 0 of an FSDP2
    # run): the policy is built on the meta device from its config alone, no weight file read; process 0's weights
    # reach this process's shards in setup_fsdp
    import torch

    meta = torch.empty(0).is_meta
    with sizes_context(path):  # a tiny π0 / π0.5 (tests, the CPU recipe) builds at its own sizes
        # a directory that carries its VLM / tokenizer (grove's exports) reads them where it is now
        if meta:
            policy = _meta_policy(family, path)
        else:
            policy = policy_class(family).from_pretrained(path, local_files_only=True, config=policy_config_here(path))
    # the processors hold the normalisation statistics, read from the directory's processor files (not from the
    # model), so every process has them; built outside the meta device so that no tensor a step creates rather
    # than reads lands there (the test compares them with one process's)
    with torch.device("cpu"):
        pre, post = make_pre_post_processors(policy.config, pretrained_path=path,
                                             preprocessor_overrides=preprocessor_overrides_here(path))
    vla = LeRobotVLA(policy, pre, post, cameras, sizes, k, env_action_dim)
    vla.tiny = read_tiny(path) if Path(path).is_dir() else None
    if settings.lora.rank:
        lo = settings.lora
        vla.add_lora(lo.rank, lo.alpha, lo.vlm, lo.targets, seed)
    if noise_head:
        vla.add_noise_head(tuple(settings.noise.hidden), settings.noise.std_min, settings.noise.std_max, seed)
    if settings.gradient_checkpointing:
        vla.enable_gradient_checkpointing()
    return vla


def _meta_policy(family: str, path: str):
    """The LeRobot policy of ``path`` on the meta device, as ``from_pretrained`` would build it but without reading
    a weight: its config (the carried VLM's location kept), constructed with ``device`` = meta (π0 / π0.5 move
    themselves to ``config.device`` in ``__init__``) and SmolVLA's VLM from its config (``load_vlm_weights`` off; its
    bf16 dtype kept, as ``from_pretrained`` of the VLM gives it), then the config's own values put back: the policy
    and the processors see the run's device. The dtypes must equal process 0's (``shard_from_rank0`` checks)."""
    import torch
    from lerobot.configs.policies import PreTrainedConfig

    from .local_files import policy_config_here

    config = policy_config_here(path) or PreTrainedConfig.from_pretrained(path, local_files_only=True)
    device, vlm_weights = config.device, getattr(config, "load_vlm_weights", None)
    config.device = "meta"
    if vlm_weights:
        config.load_vlm_weights = False
    try:
        with torch.device("meta"):
            policy = policy_class(family)(config)
    finally:
        config.device = device
        if vlm_weights is not None:
            config.load_vlm_weights = vlm_weights
    if vlm_weights:  # SmolVLMWithExpertModel loads its VLM with torch_dtype="bfloat16"
        policy.model.vlm_with_expert.vlm.to(torch.bfloat16)
    return policy.eval()
