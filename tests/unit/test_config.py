"""Run configs: TOML files, --set overrides, and clear errors for typos and bad values."""

from __future__ import annotations

import pytest

from ddiloco.config import RunConfig, load_config, to_toml
from ddiloco.errors import ConfigError


def test_defaults_are_the_demo():
    cfg = load_config()
    assert cfg.train.learners == 4 and cfg.runtime == "sim"
    assert cfg.methods == ("decoupled", "data_parallel")


def test_overrides_are_typed_toml_values():
    cfg = load_config(
        None, ["sync.quorum=2", "sync.codec=int4", "hardware.speed=[1, 1, 1.18, 1.18]"]
    )
    assert cfg.sync.rounds.quorum == 2 and cfg.sync.codec.answers == "int4"
    assert cfg.hardware.speed == (1.0, 1.0, 1.18, 1.18)


@pytest.mark.parametrize("name", ["smoke", "demo", "processes"])
def test_shipped_configs_load_and_round_trip_through_toml(tmp_path, name):
    cfg = load_config(f"configs/{name}.toml", ["seed=7"])
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "override,field",
    [
        ("sync.quorun=2", "sync.quorun"),
        ("train.learners=0", "train.learners"),
        ("sync.quorum=9", "sync.rounds.quorum"),  # (named as it is now)
        ("sync.codec=int3", "codec"),
        ("sync.partition=random", "sync.partition"),
        ("train.tokens=lots", "train.tokens"),
        ("hardware.speed=[1, 2]", "hardware.speed"),
        ("methods=['magic']", "methods"),
        ("runtime=quantum", "runtime"),
        ("nonsense", "--set"),
        ("processes.http_actions='yes'", "processes.http_actions"),
        ("override", "key"),
        ("train.optimizer=lion", "train.optimizer"),
        ("train.schedule=step", "train.schedule"),
        ("train.precision=fp8", "train.precision"),
        ("train.betas=[0.9]", "train.betas"),
        ("train.betas=[0.9, 1.5]", "train.betas"),
        ("train.grad_accum=0", "train.grad_accum"),
        ("train.seq_len=-1", "train.seq_len"),
        ("train.eps=0", "train.eps"),
        ("train.min_lr_ratio=2", "train.min_lr_ratio"),
        ("train.checkpoint_every=-5", "train.checkpoint_every"),
        ("processes.learner_checkpoint_every=-1", "processes.learner_checkpoint_every"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_config_is_a_frozen_dataclass():
    with pytest.raises(AttributeError):
        RunConfig().seed = 3  # type: ignore[misc]


def test_the_apply_rule_is_checked_and_a_blend_without_it_is_refused():
    assert load_config(None, ["sync.apply='carry'"]).sync.apply == "carry"
    assert load_config(None, ["sync.apply='blend'", "sync.blend=0.3"]).sync.blend == 0.3
    with pytest.raises(ConfigError, match=r"sync\.apply"):
        load_config(None, ["sync.apply='mix'"])
    with pytest.raises(ConfigError, match=r"only by sync\.apply = 'blend'"):
        load_config(None, ["sync.blend=0.3"])  # (before sync.apply, this alone blended)
    with pytest.raises(ConfigError, match=r"\(0, 1\)"):
        load_config(None, ["sync.apply='blend'", "sync.blend=0.0"])


def test_decoupled_warms_its_nesterov_momentum_up_and_the_baselines_take_their_published_step():
    from ddiloco.methods import method_for

    config = load_config(None, [])
    sync = method_for(config, "decoupled").sync
    assert (sync.outer.lr, sync.outer.momentum, sync.outer.warmup) == (0.5, 0.9, 30)  # 116
    for name in ("diloco", "streaming"):
        sync = method_for(config, name).sync
        assert (sync.merge_rule, sync.outer.lr, sync.outer.momentum) == ("mean", 0.7, 0.9)
        assert sync.outer.warmup == 0  # (momentum from the first step, as published)
    as_is = load_config(None, ["sync.mean_outer_lr=1.0", "sync.mean_outer_momentum=0.0"])
    assert method_for(as_is, "diloco").sync.outer.momentum == 0.0
    with pytest.raises(ConfigError, match=r"diloco\.outer_momentum"):  # (its name now)
        load_config(None, ["sync.mean_outer_momentum=1.0"])


def test_fixed_peer_ports_that_take_the_syncers_or_the_proxys_port_are_refused():
    bind = "processes.bind='127.0.0.1:6000'"
    with pytest.raises(ConfigError, match=r"peer ports 5999\.\.6000 include processes.bind's 6000"):
        load_config(None, [bind, "train.learners=2", "processes.peer_port=5999"])
    ray = ["runtime='ray'", bind, "train.learners=2", "processes.peer_port=6001"]
    with pytest.raises(ConfigError, match=r"the fault proxy's \(processes.bind's \+ 1\) 6001"):
        load_config(None, [*ray, "processes.proxy='drop=0.01'"])
    load_config(None, ray)  # no proxy on Ray, or not Ray: 6001 is free
    load_config(None, [bind, "train.learners=2", "processes.peer_port=6001"])


def test_the_sync_tables_nest_as_the_core_is_built_and_the_flat_keys_still_load(tmp_path):
    nested = load_config(
        None,
        [
            "sync.rounds.quorum=2",
            "sync.rounds.grace=false",
            "sync.outer.lr=0.5",
            "sync.outer.momentum=0.9",
            "sync.robust.norm_clip=8.0",
            "sync.codec.answers='int4'",
            "sync.codec.block=64",
            "diloco.inner_steps=20",
            "diloco.outer_lr=0.5",
            "streaming.outer_lr=0.5",
        ],
    )
    flat = tmp_path / "old.toml"  # a config (or a run's config.toml) of an earlier version
    flat.write_text(
        "[sync]\nquorum = 2\ngrace = false\nouter_lr = 0.5\nouter_momentum = 0.9\n"
        'norm_clip = 8.0\ncodec = "int4"\ncodec_block = 64\ndiloco_inner_steps = 20\n'
    )
    old = load_config(flat, ["sync.mean_outer_lr=0.5"])
    assert old == nested  # (the flat mean_outer_lr feeds both baselines' tables)
    core = nested.sync.syncer_config()
    assert core.rounds.quorum == 2 and not core.rounds.grace.enabled
    assert (core.outer.lr, core.outer.momentum, core.robust.norm_clip) == (0.5, 0.9, 8.0)
    assert nested.sync.codec.answers_spec().block_size == 64
    assert "\n[sync.rounds]\nquorum = 2\n" in to_toml(nested)
    # a bad value given under its earlier name: the error names what the user wrote too
    with pytest.raises(ConfigError, match=r"sync\.rounds\.quorum=9: .*\(given as sync\.quorum, "):
        load_config(None, ["train.learners=4", "sync.quorum=9"])
    with pytest.raises(ConfigError, match=r"given twice: as sync\.quorum and as sync\.rounds"):
        load_config(None, ["sync.quorum=2", "sync.rounds.quorum=3"])
    with pytest.raises(ConfigError, match=r"as sync\.mean_outer_lr and as diloco\.outer_lr"):
        load_config(None, ["sync.mean_outer_lr=0.5", "diloco.outer_lr=0.7"])
    with pytest.raises(ConfigError, match=r"sync\.rounds\.quorom.*unknown key"):
        load_config(None, ["sync.rounds.quorom=2"])


@pytest.mark.parametrize(
    "override,hint",
    [  # what a shell leaves of --set methods=["decoupled"] typed without single quotes
        ("methods=[decoupled]", """--set 'methods=["decoupled"]'"""),
        ("methods=[decoupled,data_parallel]", """--set 'methods=["decoupled","data_parallel"]'"""),
        ('methods=["decoupled", streaming]', """--set 'methods=["decoupled", "streaming"]'"""),
        ("sync={partition=layer}", """--set 'sync={partition="layer"}'"""),
    ],
)
def test_an_unquoted_string_in_a_toml_list_gets_the_quoted_form_as_a_hint(override, hint):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    message = str(caught.value)
    assert message.startswith(f"--set={override!r}: not a TOML ")
    assert "need double quotes" in message and message.endswith(hint)
    load_config(None, [hint.removeprefix("--set '").removesuffix("'")])  # the hint works


def test_a_bare_word_where_a_list_goes_gets_the_list_form_as_a_hint():
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["methods=decoupled"])
    assert str(caught.value) == (
        "methods='decoupled': expected a list (strings quoted), e.g. "
        """--set 'methods=["decoupled"]'"""
    )
    with pytest.raises(ConfigError, match=r"not a TOML list \(.*at column 2\)\); strings in a"):
        load_config(None, ["methods=[decoupled"])  # no fix to offer: the why only
    assert load_config(None, ["name=plain words"]).name == "plain words"  # still a string


def test_a_learners_mmap_threshold_beyond_glibcs_limit_or_negative_is_refused_by_name():
    assert load_config().processes.learner_mmap_threshold == 8 << 20
    assert load_config(None, ["processes.learner_mmap_threshold=0"])  # glibc's own
    for bad in (-1, (32 << 20) + 1):
        with pytest.raises(ConfigError, match=r"processes\.learner_mmap_threshold"):
            load_config(None, [f"processes.learner_mmap_threshold={bad}"])
