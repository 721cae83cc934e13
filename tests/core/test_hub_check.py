"""``shared_rl.preflight.check_hub_model``: a hub id is answered from the local cache folder and one bounded
connection attempt — cached ids pass, an uncached one passes only while the Hub can be reached, and a refusal names
the nearest cached or shipped id. No test here touches the network: the Hub is a local socket or a closed port."""
from __future__ import annotations

import socket

import pytest

from shared_rl.errors import ConfigError
from shared_rl.preflight import cached_hub_ids, check_hub_model, hub_unreachable, recipe_hub_ids


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    (root / "models--acme--tiny-pipe" / "snapshots" / "0123abcd").mkdir(parents=True)
    (root / "models--acme--no-snapshot" / "snapshots").mkdir(parents=True)  # an interrupted download holds nothing
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return root


def test_the_cache_folder_lists_the_ids_with_a_snapshot(cache):
    assert cached_hub_ids() == ["acme/tiny-pipe"]


def test_offline_a_cached_id_passes_and_a_typo_is_one_line_naming_the_cached_one(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_hub_model("acme/tiny-pipe", "visgen.model")
    with pytest.raises(ConfigError, match=r"^visgen.model 'acme/tiny-pip' is not in the local Hugging Face cache "
                                          r"\(.*hub\) and the Hub cannot be reached \(HF_HUB_OFFLINE is set\) "
                                          r"\(did you mean 'acme/tiny-pipe'\?\); download it once"):
        check_hub_model("acme/tiny-pip", "visgen.model")


def test_the_ids_the_recipes_name_are_suggested_too(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "stabilityai/stable-diffusion-3.5-medium" in recipe_hub_ids()
    with pytest.raises(ConfigError, match=r"did you mean 'stabilityai/stable-diffusion-3.5-medium'\?"):
        check_hub_model("stabilityai/stable-diffusion-3.5-mediun", "visgen.model")
    with pytest.raises(ConfigError) as refused:  # an uncached shipped id is refused without suggesting itself
        check_hub_model("stabilityai/stable-diffusion-3.5-medium", "visgen.model")
    assert "did you mean" not in str(refused.value)


def test_a_hub_that_refuses_the_connection_is_unreachable_and_a_listening_one_is_not(cache, monkeypatch):
    with socket.socket() as closed:  # a port nothing listens on once this socket is closed
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert "127.0.0.1" in hub_unreachable()
    with pytest.raises(ConfigError, match="the Hub cannot be reached"):
        check_hub_model("acme/other", "visgen.model")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub_unreachable() is None
        check_hub_model("acme/other", "visgen.model")  # reachable: the loader will say what the Hub says
