"""Config parsing: names, lists, profiles, prefixes, env files, and one-line failures."""


import pytest

from appliance import config
from appliance.config import ConfigError, load
from tests.harness.fleet import Fleet


def test_defaults_match_the_contract():
    c = load({})
    assert c.hub.listen == "0.0.0.0:8080"
    assert c.node.listen == "0.0.0.0:9090"
    assert c.node.model_slots == 1 and c.node.max_concurrency is None
    assert c.node.heartbeat_seconds == 2
    assert c.engine.kind == "ollama" and c.engine.url == "http://127.0.0.1:11434"
    assert c.engine.command == "llama-server -m {model} --port {port} {args}"
    assert c.engine.start_timeout_seconds == 120
    assert [(m.name, m.size_mb, m.load_seconds) for m in c.sim.effective_models()] == [("sim-small",
                                                                                        500, 0)]
    assert c.sim.tokens_per_second == 200 and c.sim.parallel == 4
    assert c.router.activation_wait_seconds == 45
    assert (c.queue.max_wait_seconds, c.queue.max_depth, c.queue.slot_wait_seconds) == (30, 64, 0)
    assert (c.priority.enabled, c.priority.reserve_slots,
            c.priority.background_max_wait_seconds) == (False, 1, 600)
    assert c.models.park_after_failures == 5
    assert c.hub.max_body_bytes == 32 * 1024 * 1024
    assert c.hub.drain_seconds == 30
    assert c.audit.path == ""
    assert c.metrics.listen is None


def test_lists_sections_profiles_and_prefix():
    c = load({
        "Nodes__1__Name": "b", "Nodes__1__Url": "http://b:9090",
        "Nodes__0__Name": "a", "Nodes__0__Url": "http://a:9090",
        "Auth__Clients__0__Name": "ops", "Auth__Clients__0__Key": "k1",
        "Auth__Clients__0__Priority": "essential",
        "Auth__Clients__0__Models": "llama*, qwen2.5:0.5b",
        "APPLIANCE_MODELS__0__NAME": "m", "Models__0__Profile": "fast",
        "Models__ParkAfterFailures": "3",
        "Profiles__fast__Args": "-c 2048",
        "node__maxconcurrency": "8",
        "PATH": "/usr/bin", "Unrelated__Thing": "x",
    })
    assert [n.name for n in c.nodes] == ["a", "b"]
    assert c.auth.clients[0].priority == "essential"
    assert c.auth.clients[0].models == ["llama*", "qwen2.5:0.5b"]
    assert c.models.items[0].name == "m" and c.models.park_after_failures == 3
    assert c.profiles["fast"].args == "-c 2048"
    assert c.node.max_concurrency == 8


@pytest.mark.parametrize("env,expect", [
    ({"Node__MaxConcurrency": "lots"}, "Node__MaxConcurrency='lots'"),
    ({"Node__MaxConcurency": "3"}, 'did you mean "MaxConcurrency"'),
    ({"Auth__Clients__0__Key": "k", "Auth__Clients__0__Priority": "essentail"},
     'did you mean "essential"'),
    ({"Priority__ReserveSlots": "-1"}, "Priority__ReserveSlots='-1'"),
    ({"Priority__BackgroundMaxWaitSeconds": "-5"}, "Priority__BackgroundMaxWaitSeconds"),
    ({"Priority__Enabled": "maybe"}, "Priority__Enabled='maybe'"),
    ({"Engine__Kind": "olama"}, 'did you mean "ollama"'),
    ({"Hub__Listen": "8080"}, "Hub__Listen='8080': expected HOST:PORT"),
    ({"Nodes__0__Name": "a", "Nodes__0__Url": "gpu-a:9090"}, "Nodes__0__Url"),
    ({"Models__0__Name": "m", "Models__0__Profile": "fsat", "Profiles__fast__Args": ""},
     'did you mean "fast"'),
    ({"Auth__Clients__0__Name": "x"}, "Auth__Clients__0__Key is empty"),
    ({"Hub__Workers": "0"}, "Hub__Workers=0: must be 1..8"),
    ({"Hub__Workers": "9"}, "Hub__Workers=9: must be 1..8"),
])
def test_bad_values_name_the_variable(env, expect):
    with pytest.raises(ConfigError) as e:
        load(env)
    msg = str(e.value)
    assert expect in msg
    assert "\n" not in msg


def test_env_file_then_environment(tmp_path):
    f = tmp_path / "hub.env"
    f.write_text(
        "# comment\nHub__Listen=127.0.0.1:1234\nexport "
        "Queue__MaxDepth='9'\nAuth__AdminKey=\"s3cret\"\n")
    c = load({"Queue__MaxDepth": "10"}, env_file=str(f))
    assert c.hub.listen == "127.0.0.1:1234"
    assert c.queue.max_depth == 10
    assert c.auth.admin_key == "s3cret"
    f.write_text("not a line\n")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load({}, env_file=str(f))


def test_parse_listen():
    assert config.parse_listen("0.0.0.0:0") == ("0.0.0.0", 0)
    assert config.parse_listen("[::1]:80") == ("::1", 80)
    with pytest.raises(ConfigError):
        config.parse_listen("host:99999")


def test_cli_exits_2_with_one_line():
    r = Fleet(token=None).run("hub", {"Priority__Enabled": "true", "Auth__Clients__0__Key": "k",
                                      "Auth__Clients__0__Priority": "backgroud"})
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1
    assert "Auth__Clients__0__Priority='backgroud'" in lines[
        0] and 'did you mean "background"' in lines[0]


def test_cli_version():
    r = Fleet().run("--version", {})
    assert r.returncode == 0 and r.stdout.startswith("appliance 0.1.0")


@pytest.mark.parametrize("env,names", [
    ({"Auth__Clients__0__Name": "a", "Auth__Clients__0__Key": "k", "Auth__Clients__1__Name": "b",
      "Auth__Clients__1__Key": "k"}, ("Auth__Clients__0__Key", "Auth__Clients__1__Key")),
    ({"Auth__Clients__0__Name": "a", "Auth__Clients__0__Key": "k1", "Auth__Clients__1__Name": "a",
      "Auth__Clients__1__Key": "k2"}, ("Auth__Clients__0__Name", "Auth__Clients__1__Name")),
    ({"Nodes__0__Name": "n", "Nodes__0__Url": "http://a:1", "Nodes__1__Name": "n",
      "Nodes__1__Url": "http://b:1"},
     ("Nodes__0__Name", "Nodes__1__Name")),
    ({"Auth__Nodes__0__Name": "n", "Auth__Nodes__0__Token": "a", "Auth__Nodes__1__Name": "n",
      "Auth__Nodes__1__Token": "b"}, ("Auth__Nodes__0__Name", "Auth__Nodes__1__Name")),
    ({"Hub__DrainSeconds": "inf"}, ("Hub__DrainSeconds",)),
    ({"Queue__MaxWaitSeconds": "Infinity"}, ("Queue__MaxWaitSeconds",)),
    ({"Hub__NodeNetworks": "10.0.0.0/8,nope"}, ("Hub__NodeNetworks",)),
    ({"Nodes__0__Name": "a/b", "Nodes__0__Url": "http://a:1"}, ("Nodes__0__Name",)),
])
def test_duplicates_and_unbounded_numbers_are_refused_naming_the_variables(env, names):
    with pytest.raises(ConfigError) as e:
        load(env)
    for n in names:
        assert n in str(e.value)
    assert "\n" not in str(e.value)


def test_per_node_token_falls_back_to_the_shared_one():
    a = load({"Auth__NodeToken": "shared", "Auth__Nodes__0__Name": "gpu-b",
              "Auth__Nodes__0__Token": "bee"}).auth
    assert a.node_token_for("gpu-b") == "bee" and a.node_token_for("gpu-a") == "shared"


def test_node_reads_its_own_settings_and_the_old_hub_names_with_a_warning():
    from appliance.config import node_deprecations

    cfg = load({"Node__MaxBodyBytes": "1000", "Node__UpstreamReadSeconds": "7",
                "Node__DrainSeconds": "3", "Hub__MaxBodyBytes": "5000"})
    assert (cfg.node.max_body_bytes, cfg.node.upstream_read_seconds,
            cfg.node.drain_seconds) == (1000, 7.0, 3.0)
    assert cfg.hub.max_body_bytes == 5000  # the hub keeps its own
    assert node_deprecations({"Node__MaxBodyBytes": "1000", "Hub__MaxBodyBytes": "5000"}) == []
    old = {"Hub__MaxBodyBytes": "2000", "APPLIANCE_Hub__DrainSeconds": "4"}
    cfg = load(old)
    assert (cfg.node.max_body_bytes, cfg.node.drain_seconds) == (2000, 4.0)
    assert cfg.node.upstream_read_seconds == 600.0  # neither set: the default
    lines = node_deprecations(old)
    assert len(lines) == 2 and "Hub__MaxBodyBytes" in lines[0] and "Node__DrainSeconds" in lines[1]


@pytest.mark.parametrize("env, var", [
    ({"Auth__Clients__0__Key": "k1", "Auth__Clients__1__Key": "k1 "}, "Auth__Clients__1__Key"),
    ({"Auth__Clients__0__Key": "\tk1", "Auth__Clients__1__Key": "k1"}, "Auth__Clients__0__Key"),
    ({"Auth__Clients__0__Key": "k 1"}, "Auth__Clients__0__Key"),
    ({"Auth__AdminKey": "adm\n"}, "Auth__AdminKey"),
    ({"Auth__NodeToken": " tok"}, "Auth__NodeToken"),
    ({"Auth__Nodes__0__Name": "a", "Auth__Nodes__0__Token": "t\x00"}, "Auth__Nodes__0__Token"),
])
def test_a_key_with_white_space_is_refused_at_start(env, var):
    # The hub strips a presented key: "k1 " and "k1" would be one key to every client,
    # and " tok" none (issue 30 item 8).
    with pytest.raises(ConfigError, match=f"^{var} holds white space"):
        load(env)
