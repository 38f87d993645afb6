//! docker/ cannot run here (no Docker engine): check what can be checked — every file parses, the compose file
//! wires the services, and the Grafana dashboard only queries metrics `/metrics` really exports.

use std::path::Path;

use yaml_rust2::{Yaml, YamlLoader};

use crate::support::metrics_in;

fn docker_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("docker")
        .join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

fn yaml(path: &str) -> Yaml {
    let docs =
        YamlLoader::load_from_str(&docker_file(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    docs.into_iter()
        .next()
        .unwrap_or_else(|| panic!("{path} is empty"))
}

#[test]
fn compose_starts_postgres_kafka_outboxd_prometheus_and_grafana() {
    let compose = yaml("compose.yml");
    let services = compose["services"].as_hash().expect("services");
    for name in [
        "postgres",
        "kafka",
        "outboxd-migrate",
        "outboxd",
        "prometheus",
        "grafana",
    ] {
        assert!(
            services.contains_key(&Yaml::String(name.into())),
            "service {name} missing"
        );
    }
    let postgres_command: Vec<&str> = compose["services"]["postgres"]["command"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(|c| c.as_str())
        .collect();
    assert!(postgres_command.contains(&"wal_level=logical"));
    assert_eq!(
        compose["services"]["kafka"]["environment"]["KAFKA_PROCESS_ROLES"].as_str(),
        Some("broker,controller")
    );
    let outboxd_env = &compose["services"]["outboxd"]["environment"];
    assert_eq!(
        outboxd_env["OUTBOXD_METRICS_ADDR"].as_str(),
        Some("0.0.0.0:9187")
    );
    let prometheus = yaml("prometheus.yml");
    let target = prometheus["scrape_configs"][0]["static_configs"][0]["targets"][0].as_str();
    assert_eq!(target, Some("outboxd:9187"));
    yaml("grafana/provisioning/datasources/prometheus.yml");
    yaml("grafana/provisioning/dashboards/dashboards.yml");
    let dockerfile = docker_file("Dockerfile");
    assert!(
        dockerfile.contains("USER outboxd"),
        "the runtime image runs as non-root"
    );
}

#[test]
fn dashboard_queries_only_exported_metrics() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&docker_file("grafana/dashboards/outboxd.json")).unwrap();
    let mut used = std::collections::BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            used.extend(metrics_in(target["expr"].as_str().unwrap()));
        }
    }
    for name in &used {
        assert!(
            outboxd::metrics::ALL.contains(&name.as_str()),
            "the dashboard queries {name}, which /metrics does not export"
        );
    }
    for wanted in [
        "outboxd_slot_lag_bytes",
        "outboxd_unpublished_events",
        "outboxd_oldest_unpublished_age_seconds",
        "outboxd_events_published_total",
        "outboxd_commit_to_ack_seconds",
        "outboxd_publish_errors_total",
        "outboxd_mode",
    ] {
        assert!(used.contains(wanted), "the dashboard should show {wanted}");
    }
}

/// Every `OUTBOXD_*` variable the compose file sets is one outboxd reads (a misspelt name would be ignored
/// silently and the service run with a default).
#[test]
fn compose_sets_only_variables_outboxd_reads() {
    use clap::CommandFactory;
    let cli = outboxd::config::Cli::command();
    let mut known: std::collections::HashSet<String> = cli
        .get_subcommands()
        .flat_map(|command| command.get_arguments())
        .filter_map(|arg| arg.get_env())
        .map(|env| env.to_string_lossy().into_owned())
        .collect();
    known.extend(
        outboxd::config::secret_files::SECRET_VARIABLES
            .iter()
            .map(|name| format!("{name}_FILE")),
    );
    assert!(known.contains("OUTBOXD_DATABASE_URL"), "{known:?}");
    let compose = yaml("compose.yml");
    let mut checked = 0;
    for (name, service) in compose["services"].as_hash().expect("services") {
        let Some(environment) = service["environment"].as_hash() else {
            continue;
        };
        for variable in environment.keys().filter_map(|k| k.as_str()) {
            if variable.starts_with("OUTBOXD_") {
                assert!(
                    known.contains(variable),
                    "{name:?} sets {variable}, which outboxd does not read"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 5, "only {checked} OUTBOXD_ variables found");
}

/// A tag can be moved to other contents, a digest cannot: every image compose pulls and every base image of
/// the Dockerfile is named by a digest (outboxd's own image is built from the Dockerfile).
#[test]
fn every_image_pulled_is_pinned_by_digest() {
    let pinned = |reference: &str| {
        reference.split_once("@sha256:").is_some_and(|(_, digest)| {
            digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit())
        })
    };
    let compose = yaml("compose.yml");
    let mut images = 0;
    for (name, service) in compose["services"].as_hash().expect("services") {
        if let Some(image) = service["image"].as_str() {
            images += 1;
            assert!(pinned(image), "{name:?}: {image} is not pinned by digest");
        }
    }
    assert!(images >= 4, "{images} images in compose");
    let dockerfile = docker_file("Dockerfile");
    let bases: Vec<&str> = dockerfile
        .lines()
        .filter_map(|line| line.strip_prefix("FROM "))
        .collect();
    assert_eq!(bases.len(), 2, "{bases:?}");
    for base in bases {
        assert!(
            pinned(base.split_whitespace().next().unwrap_or_default()),
            "{base}"
        );
    }
}
