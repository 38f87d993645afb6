//! deploy/kubernetes/ cannot run here (no cluster): every manifest is validated against the Kubernetes
//! schemas with a real validator (`kubernetes-validate --strict`, installed by `install-deps.sh`), and the
//! pieces are checked against each other and against what outboxd serves: the probes' paths and port, the
//! settings file it is given, the variables it reads, the metrics the alert rules query.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use yaml_rust2::{Yaml, YamlLoader};

use crate::support::*;

fn manifests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes")
}

fn manifest(name: &str) -> Yaml {
    let path = manifests_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    YamlLoader::load_from_str(&text)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("{name} is empty"))
}

/// The manifests kustomization.yaml applies (all of them: checked below).
fn resources() -> Vec<String> {
    manifest("kustomization.yaml")["resources"]
        .as_vec()
        .expect("resources")
        .iter()
        .map(|r| r.as_str().expect("a resource file name").to_string())
        .collect()
}

/// Kinds without a schema among the Kubernetes ones (custom resources): checked by the tests below instead.
const CUSTOM_KINDS: [&str; 1] = ["PrometheusRule"];

fn kubernetes_validate(files: &[PathBuf]) -> std::process::Output {
    std::process::Command::new(python_tool("kubernetes-validate"))
        .arg("--strict")
        .args(files)
        .output()
        .expect("cannot run kubernetes-validate")
}

#[test]
fn every_manifest_validates_against_the_kubernetes_schemas() {
    let files: Vec<PathBuf> = resources()
        .iter()
        .filter(|name| {
            let kind = manifest(name)["kind"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            !CUSTOM_KINDS.contains(&kind.as_str())
        })
        .map(|name| manifests_dir().join(name))
        .collect();
    assert!(files.len() >= 5, "only {} manifests", files.len());
    let output = kubernetes_validate(&files);
    let report = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    println!("{report}");
    assert!(
        output.status.success(),
        "kubernetes-validate failed:\n{report}"
    );
    assert_eq!(
        report.matches(" passed for resource ").count(),
        files.len(),
        "not every manifest was validated:\n{report}"
    );
}

/// The validator rejects what the schemas forbid (so the test above can fail).
#[test]
fn the_validator_rejects_a_broken_manifest() {
    let dir = scratch_dir("kubernetes");
    let broken = dir.join("deployment.yaml");
    let text = std::fs::read_to_string(manifests_dir().join("deployment.yaml")).unwrap();
    let text = text.replacen("replicas: 2", "replicas: two", 1);
    let text = text.replacen("readinessProbe:", "readinessProbes:", 1);
    std::fs::write(&broken, text).unwrap();
    let output = kubernetes_validate(&[broken]);
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        !output.status.success(),
        "a broken Deployment passed: {report}"
    );
}

#[test]
fn kustomization_applies_every_manifest() {
    let listed: BTreeSet<String> = resources().into_iter().collect();
    let present: BTreeSet<String> = std::fs::read_dir(manifests_dir())
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name.ends_with(".yaml") && name != "kustomization.yaml")
        .collect();
    assert_eq!(
        listed, present,
        "kustomization.yaml and the directory differ"
    );
}

/// The Deployment's container, probes, ports, settings file and Secret fit together and fit outboxd.
#[test]
fn the_deployment_fits_its_config_map_secret_and_outboxd() {
    let deployment = manifest("deployment.yaml");
    let pod = &deployment["spec"]["template"];
    let container = &pod["spec"]["containers"][0];
    assert_eq!(
        deployment["spec"]["replicas"].as_i64(),
        Some(2),
        "a leader and a standby"
    );
    // A rolling update would wait for the new pods to be Ready, which a standby never is.
    assert_eq!(
        deployment["spec"]["strategy"]["type"].as_str(),
        Some("Recreate")
    );

    let port = &container["ports"][0];
    assert_eq!(port["name"].as_str(), Some("metrics"));
    let container_port = port["containerPort"].as_i64().unwrap();
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"].as_str(), Some(path), "{probe}");
        assert_eq!(get["port"].as_str(), Some("metrics"), "{probe}");
    }
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(
        annotations["prometheus.io/port"].as_str(),
        Some(container_port.to_string().as_str())
    );
    assert_eq!(annotations["prometheus.io/path"].as_str(), Some("/metrics"));
    assert_eq!(
        manifest("service.yaml")["spec"]["publishNotReadyAddresses"].as_bool(),
        Some(true),
        "a standby's metrics would not be discovered"
    );

    // The settings file: mounted where the arguments say, listening where the probes look.
    let args: Vec<&str> = container["args"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let config_path = args[args.iter().position(|a| *a == "--config").unwrap() + 1];
    let mount = &container["volumeMounts"][0];
    let key = Path::new(config_path)
        .strip_prefix(mount["mountPath"].as_str().unwrap())
        .unwrap();
    let config_map = manifest("configmap.yaml");
    assert_eq!(
        pod["spec"]["volumes"][0]["configMap"]["name"].as_str(),
        config_map["metadata"]["name"].as_str()
    );
    let toml_text = config_map["data"][key.to_str().unwrap()]
        .as_str()
        .expect("the settings file");
    let settings: toml::Table = toml_text.parse().expect("the settings file is TOML");
    let metrics_addr = settings["metrics-addr"].as_str().unwrap();
    assert_eq!(
        metrics_addr,
        format!("0.0.0.0:{container_port}"),
        "outboxd must listen on the pod's address, on the probes' port"
    );
    let shutdown =
        humantime::parse_duration(settings["shutdown-timeout"].as_str().unwrap()).unwrap();
    let grace = pod["spec"]["terminationGracePeriodSeconds"]
        .as_i64()
        .unwrap();
    assert!(
        Duration::from_secs(grace as u64) > shutdown,
        "Kubernetes would kill outboxd before its --shutdown-timeout"
    );

    // Every variable is one outboxd reads, from a key the Secret has: as a file the Secret's volume holds
    // (`OUTBOXD_X_FILE`, the container convention) or as a reference to the key.
    use clap::CommandFactory;
    let mut known: BTreeSet<String> = outboxd::config::Cli::command()
        .get_subcommands()
        .flat_map(|command| command.get_arguments())
        .filter_map(|arg| arg.get_env())
        .map(|env| env.to_string_lossy().into_owned())
        .collect();
    let secret_files: Vec<String> = outboxd::config::secret_files::SECRET_VARIABLES
        .iter()
        .map(|name| format!("{name}_FILE"))
        .collect();
    known.extend(secret_files.iter().cloned());
    let secret = manifest("secret.yaml");
    let secret_name = secret["metadata"]["name"].as_str();
    let secret_mount = pod["spec"]["volumes"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|volume| volume["secret"]["secretName"].as_str() == secret_name)
        .and_then(|volume| {
            container["volumeMounts"]
                .as_vec()
                .unwrap()
                .iter()
                .find(|mount| mount["name"] == volume["name"])
        })
        .and_then(|mount| mount["mountPath"].as_str());
    let env = container["env"].as_vec().unwrap();
    assert!(env.len() >= 2);
    for variable in env {
        let name = variable["name"].as_str().unwrap();
        assert!(
            known.contains(name),
            "the Deployment sets {name}, which outboxd does not read"
        );
        let key = if secret_files.iter().any(|file| file == name) {
            let path = Path::new(variable["value"].as_str().expect("a path"));
            let mount = secret_mount.expect("the Secret mounted as a volume");
            path.strip_prefix(mount)
                .unwrap_or_else(|_| {
                    panic!("{name}: {} is not in the Secret's volume", path.display())
                })
                .to_str()
                .unwrap()
                .to_string()
        } else {
            let reference = &variable["valueFrom"]["secretKeyRef"];
            assert_eq!(reference["name"].as_str(), secret_name);
            reference["key"].as_str().unwrap().to_string()
        };
        assert!(
            secret["stringData"][key.as_str()].as_str().is_some(),
            "the Secret has no key {key}"
        );
    }
}

/// outboxd started the way the Deployment starts it (the ConfigMap's file, the URLs from the Secret's files)
/// answers the probes' paths and exports every metric the alert rules query.
#[tokio::test(flavor = "multi_thread")]
async fn outboxd_serves_the_probes_and_metrics_the_manifests_use() {
    let (pg, broker) = migrated_stack();
    let config_map = manifest("configmap.yaml");
    let file = scratch_dir("kubernetes").join("outboxd.toml");
    std::fs::write(&file, config_map["data"]["outboxd.toml"].as_str().unwrap()).unwrap();
    let url = pg.url();
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let brokers = broker.addr();
    // The URLs as the Secret's files, as the Deployment gives them (with a trailing newline, as an editor
    // leaves it).
    let url_file = scratch_dir("kubernetes").join("database-url");
    std::fs::write(&url_file, format!("{url}\n")).unwrap();
    let url_file = url_file.to_str().unwrap();
    let outboxd = Outboxd::spawn_with_env(
        &["run", "--config", file.to_str().unwrap()],
        &[
            ("OUTBOXD_DATABASE_URL_FILE", url_file),
            ("OUTBOXD_REPLICATION_URL_FILE", url_file),
            // The cluster's addresses and replication factor, for this machine's single broker.
            ("OUTBOXD_BROKERS", brokers.as_str()),
            ("OUTBOXD_TOPIC_REPLICATION_FACTOR", "1"),
            ("OUTBOXD_METRICS_ADDR", metrics_addr.as_str()),
        ],
    );
    let ready = wait_for("/readyz to answer 200", Duration::from_secs(120), || {
        http_get(&metrics_addr, "/readyz").filter(|(status, _)| *status == 200)
    });
    println!("/readyz: {}", ready.1);
    assert_eq!(http_get(&metrics_addr, "/healthz").map(|r| r.0), Some(200));
    let (status, metrics) = http_get(&metrics_addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    let rules = manifest("prometheusrule.yaml");
    for rule in rules["spec"]["groups"][0]["rules"].as_vec().unwrap() {
        let alert = rule["alert"].as_str().unwrap();
        for metric in metrics_in(rule["expr"].as_str().unwrap()) {
            assert!(
                metrics.lines().any(|line| line.starts_with(&metric)),
                "alert {alert} queries {metric}, which /metrics does not serve"
            );
        }
    }
    drop(outboxd);
}

/// The alert rules are the README's suggestions, each on a metric outboxd exports.
#[test]
fn the_alert_rules_query_exported_metrics() {
    let rules = manifest("prometheusrule.yaml");
    assert_eq!(
        rules["apiVersion"].as_str(),
        Some("monitoring.coreos.com/v1")
    );
    let rules = rules["spec"]["groups"][0]["rules"].as_vec().expect("rules");
    let mut used = BTreeSet::new();
    for rule in rules {
        let alert = rule["alert"].as_str().expect("every rule is an alert");
        let expr = rule["expr"]
            .as_str()
            .unwrap_or_else(|| panic!("{alert} has no expr"));
        if let Some(duration) = rule["for"].as_str() {
            humantime::parse_duration(duration)
                .unwrap_or_else(|e| panic!("{alert}: for {duration:?}: {e}"));
        }
        assert!(
            rule["labels"]["severity"].as_str().is_some(),
            "{alert} has no severity"
        );
        let metrics = metrics_in(expr);
        assert!(!metrics.is_empty(), "{alert} queries no outboxd metric");
        for metric in &metrics {
            assert!(
                outboxd::metrics::ALL.contains(&metric.as_str()),
                "{alert} queries {metric}, which /metrics does not export"
            );
        }
        used.extend(metrics);
    }
    // Every metric the README gives an alert suggestion for.
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let suggested: BTreeSet<String> = readme
        .lines()
        .filter(|line| line.starts_with("| `outboxd_"))
        .filter_map(|line| {
            line.trim_start_matches("| `")
                .split(['`', '{'])
                .next()
                .map(String::from)
        })
        .filter(|name| outboxd::metrics::ALL.contains(&name.as_str()))
        .collect();
    let left_out: Vec<&String> = suggested
        .iter()
        .filter(|name| !used.contains(*name) && !NO_ALERT.contains(&name.as_str()))
        .collect();
    assert!(
        left_out.is_empty(),
        "README suggests alerts on {left_out:?}; the rules have none"
    );
}

/// Metrics whose README suggestion is not a rule here: the WAL a slot retains is judged against the disk,
/// which outboxd cannot see (the safe-WAL and WAL-status alerts cover the danger); the dead-letter counter
/// starts over with each process, so the alert is on the gauge read from the table (`outboxd_dead_events`);
/// failover readiness is 0 on every server before PostgreSQL 17 or without a standby, so a shipped rule would
/// fire for most users (README suggests it only where failover slots are run); promotions carried on through a
/// failover slot are informational; of the audit's figures, the rules alert on its findings and on how long
/// no audit was clean (which covers audits that fail), the rest are for dashboards.
const NO_ALERT: [&str; 8] = [
    "outboxd_slot_retained_wal_bytes",
    "outboxd_events_dead_total",
    "outboxd_failover_ready",
    "outboxd_failover_slot_continuations_total",
    "outboxd_audit_runs_total",
    "outboxd_audit_checked_events",
    "outboxd_audit_missing_events",
    "outboxd_audit_duplicated_events",
];
