"""Every config value of a wrong type or range is one PlaitError naming its key.

A property test feeds random TOML-like values and random flag text: the only outcomes
allowed are a PlaitError or a config that passes validation.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from plait.errors import PlaitError
from plait.families import family_of
from plait.train.config.settings import TrainConfig, build_config, field_names, load_toml, validate

NAMES = [n for n in field_names() if n not in ("out", "data")]  # out is a temp dir; data is read later
NEAR = st.integers(-2, 8)  # small integers reach the deeper layout checks
VALUES = st.one_of(
    st.none(), st.booleans(), NEAR, st.integers(-10**20, 10**20), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6), st.lists(NEAR, max_size=2), st.dictionaries(st.text(max_size=2), NEAR, max_size=1),
    st.sampled_from(["tiny", "small", "tiny,n_layers=3", "tiny,n_layers=x", "tiny,bogus=1", "1f1b", "gpipe", "bf16",
                     "full", "auto", "gloo", "10", "1e-3", "nan", "-1"]),
)


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _outcome(file_values, flag_values, out):
    try:
        config = build_config({**file_values, "out": str(out)}, flag_values, family_of)
        validate(config, family_of(config), local_limit=8)
    except PlaitError as exc:
        assert exc.message and "\n" not in exc.message
        return None
    assert isinstance(config, TrainConfig)
    return config


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(file_values=st.dictionaries(st.sampled_from(NAMES), VALUES, max_size=6))
def test_random_toml_values_give_a_plait_error_or_a_valid_config(file_values, tmp_path):
    _outcome(file_values, {}, tmp_path)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=st.dictionaries(st.sampled_from(NAMES), st.one_of(st.text(max_size=6), st.from_regex(r"-?\d{1,3}(\.\d)?", fullmatch=True)), max_size=5))
@example(flags={"model": "0", "imports": "0\n0"})  # found by this test: the module's name with its line break
def test_random_flag_text_gives_a_plait_error_or_a_valid_config(flags, tmp_path):
    # What argparse hands over: text, or None for flags not given (bool flags: True).
    flags = {k: (True if k in ("sp", "offload") else v) for k, v in flags.items()}
    _outcome({}, flags, tmp_path)


@pytest.mark.parametrize("text, message", [
    ('steps = "10"', "the config file: steps = '10' is a string; it must be an integer"),
    ("lr = -1", "the config file: lr must be more than 0, got -1.0"),
    ("zero = 4", "--zero must be 0, 1, 2 or 3, got 4"),
    ("sp = 1", "the config file: sp = 1 is an integer; it must be true or false"),
    ("timeout_s = nan", "the config file: timeout_s must be a finite number, got nan"),
    ("seed = 1.5", "the config file: seed = 1.5 is a number; it must be an integer"),
    ("model = 3", "the config file: model = 3 is an integer; it must be a string"),
])
def test_a_wrong_toml_value_names_its_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    with pytest.raises(PlaitError) as err:
        build_config(load_toml(str(path)), {})
    assert err.value.message == message


def test_a_wrong_flag_names_the_flag(tmp_path):
    with pytest.raises(PlaitError, match=r"^--micro-batch 'two' is not an integer$"):
        build_config({}, {"micro_batch": "two"})
    with pytest.raises(PlaitError, match=r"^--keep-checkpoints must be at least 0, got -1$"):
        build_config({}, {"keep_checkpoints": "-1"})
    assert build_config({}, {"lr": "1e-3", "steps": "7", "out": str(tmp_path)}).steps == 7
