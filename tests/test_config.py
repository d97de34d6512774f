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


def test_default_recipe_holds_no_more_16_bit_tokens_than_kivi():
    """The default recipe's 16-bit tiers hold at most as many tokens as KIVI-2's residual does at its largest,
    and fewer on average over contexts: at KIVI-2's nominal bits its physical bits are not above KIVI-2's."""
    from oscarkv.cache.tiers import TierPolicy
    from oscarkv.config import DEFAULT_RECIPE
    from oscarkv.methods import KIVI_GROUP, KIVI_RESIDUAL

    spec = QuantSpec.default_recipe()
    assert spec.bit_budget == DEFAULT_RECIPE["bit_budget"] == "kivi" and spec.sink == 32 and spec.window == 64
    ours = TierPolicy(spec.sink, spec.window, spec.page_size)
    kivi = TierPolicy(0, KIVI_RESIDUAL, KIVI_GROUP)
    lengths = range(1024, 32769, 7)
    held = [n - ours.quantized(n) for n in lengths]
    kivi_held = [n - kivi.quantized(n) for n in lengths]
    assert max(held) <= max(kivi_held) and sum(held) < sum(kivi_held)
    assert QuantSpec() != spec and QuantSpec().window == 256  # the library default stays the method's spec
