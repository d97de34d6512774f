import pytest

from oscarkv.config import ConfigError, QuantSpec, valid_keys


def test_defaults_and_bits():
    s = QuantSpec()
    assert s.bits == 2 and s.sink == 64 and s.window == 256 and s.centering
    assert s.bits_per_element(128) == 2.25 and s.bits_per_element(64) == 2.5
    assert QuantSpec(bits=4).bits_per_element(128) == 4.25


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match="valid keys") as e:
        QuantSpec.from_dict({"bits": 2, "windw": 128})
    assert "windw" in str(e.value) and "window" in str(e.value)
    with pytest.raises(ConfigError):
        QuantSpec().replace(sinks=3)


@pytest.mark.parametrize(
    "bad",
    [{"bits": 3}, {"meta_dtype": "float8"}, {"k_clip": 1.5}, {"k_clip": "auto"}, {"composition": "uph"},
     {"granularity": "token"}, {"sink": -1}, {"page_size": 0}, {"clip_grid": []}, {"centering": "yes"}],
)
def test_validation(bad):
    with pytest.raises(ConfigError):
        QuantSpec.from_dict(bad)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_round_trip(tmp_path, suffix):
    s = QuantSpec(k_clip=0.95, v_clip="fitted", granularity="head", group_size=32, window=128)
    p = tmp_path / f"spec{suffix}"
    s.save(p)
    assert QuantSpec.load(p) == s
    with pytest.raises(ConfigError):
        s.save(tmp_path / "spec.txt")


def test_frozen():
    with pytest.raises(Exception):
        QuantSpec().bits = 4  # type: ignore[misc]
    assert "bits" in valid_keys()


def test_default_recipe_is_whole_pages_and_kivi_bits():
    """The default recipe's sink and window are whole pages (the vLLM plugin keeps 16-bit rows in whole blocks of
    the page size, so every front-end serves the default artifact); its 16-bit tiers hold the sink plus one to two
    window pages, and the per-layer selection spends KIVI-2's nominal bits."""
    from oscarkv.cache.tiers import TierPolicy
    from oscarkv.config import DEFAULT_RECIPE

    spec = QuantSpec.default_recipe()
    assert spec.bit_budget == DEFAULT_RECIPE["bit_budget"] == "kivi"
    assert spec.sink % spec.page_size == 0 and spec.window % spec.page_size == 0 and spec.sink > 0
    ours = TierPolicy(spec.sink, spec.window, spec.page_size)
    held = [n - ours.quantized(n) for n in range(1024, 32769, 7)]
    assert min(held) == spec.sink + spec.window and max(held) < spec.sink + spec.window + spec.page_size
    assert QuantSpec() != spec and QuantSpec().window == 256  # the library default stays the method's spec
