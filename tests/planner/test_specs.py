"""Cluster and model descriptions: presets, HF configs, the launch environment."""
import pytest

from ds_wallfacer.planner import CLUSTERS, MODELS, ModelSpec, from_env, get_cluster, get_model


def test_presets():
    h = CLUSTERS["h100x64"]
    assert (h.nodes, h.ranks_per_node, h.world_size) == (8, 8, 64)
    assert h.offnode_bw(8) == h.nic_bw  # one NIC per GPU
    eth = CLUSTERS["a100x32-eth"]
    assert eth.offnode_bw(8) == pytest.approx(eth.nic_bw / 8)  # one port shared by the node
    assert {"h200x1", "cpu"} <= set(CLUSTERS)
    assert 7.9e9 < MODELS["llama3-8b"].params < 8.1e9
    assert 6.6e9 < MODELS["llama2-7b"].params < 6.9e9
    assert MODELS["llama-30b-like"].head_dim == 128


def test_from_hf_config_dict_and_object():
    cfg = {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "vocab_size": 152064, "model_type": "qwen2"}
    m = ModelSpec.from_hf_config(cfg)
    assert (m.layers, m.kv_heads, m.head_dim) == (28, 4, 128)
    assert m.params == get_model("qwen2-7b").params
    transformers = pytest.importorskip("transformers")
    obj = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=100)
    assert get_model(obj).kv_heads == 2
    with pytest.raises(ValueError, match="lacks"):
        ModelSpec.from_hf_config({"hidden_size": 8})


def test_from_env():
    c = from_env("h100x64", {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert (c.nodes, c.ranks_per_node, c.nic_bw) == (2, 8, CLUSTERS["h100x64"].nic_bw)
    ds = from_env("a100x32-eth", {"WORLD_SIZE": "32", "LOCAL_SIZE": "4"})  # DeepSpeed launcher
    assert (ds.nodes, ds.ranks_per_node) == (8, 4)
    assert from_env("cpu", {"WORLD_SIZE": "4", "CROSS_SIZE": "1"}).ranks_per_node == 4
    assert from_env("cpu", {}) == CLUSTERS["cpu"]
    with pytest.raises(ValueError, match="multiple"):
        from_env("h100x64", {"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"})


def test_world_size_and_errors():
    assert get_cluster("h100x64").with_world_size(16).nodes == 2
    assert get_cluster("cpu").with_world_size(8).ranks_per_node == 8  # one machine, any rank count
    with pytest.raises(ValueError, match="whole number"):
        get_cluster("h100x64").with_world_size(20)
    with pytest.raises(ValueError, match="presets"):
        get_cluster("tpu")
    with pytest.raises(ValueError, match="presets"):
        get_model("gpt-5")
