//! The executor's metrics (`idemflow::telemetry`), read through the Prometheus exporter's
//! recorder installed for this thread only: after a known sequence of calls, every counter holds
//! what happened.

use std::sync::Arc;

use idemflow::store::sqlite::SqliteStore;
use idemflow::{Error, Idempotency, IdempotentRequest, Outcome, Store, StoredResponse};
use metrics_exporter_prometheus::PrometheusBuilder;

fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn req(key: &str, amount: u64) -> IdempotentRequest {
    IdempotentRequest::new("acct", key, "pay", &serde_json::json!({"amount": amount})).unwrap()
}

fn ok() -> Outcome {
    Outcome::Succeeded(StoredResponse::json(201, &serde_json::json!({"ok": 1})).unwrap())
}

#[test]
fn executor_counters_follow_a_known_sequence() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
            store.migrate().await.unwrap();
            let store: Arc<dyn Store> = Arc::new(store);
            let idem = Idempotency::new(store);
            // Two executed, one replayed, one fingerprint mismatch, one unknown, one in flight.
            idem.execute(req("k1", 5), |_| async { ok() })
                .await
                .unwrap();
            idem.execute(req("k2", 5), |_| async { ok() })
                .await
                .unwrap();
            assert!(
                idem.execute(req("k1", 5), |_| async { ok() })
                    .await
                    .unwrap()
                    .is_replay()
            );
            let e = idem
                .execute(req("k1", 6), |_| async { ok() })
                .await
                .unwrap_err();
            assert!(matches!(e, Error::FingerprintMismatch { .. }));
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let slow = idem.execute(req("k3", 5), |_| async move {
                let _ = rx.await;
                Outcome::unknown("timed out after sending")
            });
            let dup = async {
                tokio::task::yield_now().await;
                let r = idem.execute(req("k3", 5), |_| async { ok() }).await;
                let _ = tx.send(());
                r
            };
            let (first, second) = tokio::join!(slow, dup);
            assert!(
                matches!(first, Err(Error::OutcomeUnknown { .. })),
                "{first:?}"
            );
            assert!(matches!(second, Err(Error::InFlight { .. })), "{second:?}");
        });
    });
    let text = handle.render();
    let op = r#"operation="pay""#;
    assert_eq!(
        sample(
            &text,
            &format!(r#"idemflow_claims_total{{{op},transition="claim"}}"#)
        ),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, &format!("idemflow_replays_total{{{op}}}")),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, &format!("idemflow_in_flight_total{{{op}}}")),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            &format!("idemflow_fingerprint_mismatches_total{{{op}}}")
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            &format!(r#"idemflow_outcomes_total{{{op},outcome="succeeded"}}"#)
        ),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &text,
            &format!(r#"idemflow_outcomes_total{{{op},outcome="unknown"}}"#)
        ),
        Some(1.0)
    );
    assert!(
        text.contains(
            r#"idemflow_store_duration_seconds{backend="sqlite",call="claim",quantile="0.5"}"#
        ),
        "{text}"
    );
    assert!(
        text.contains("idemflow_operation_duration_seconds"),
        "{text}"
    );
}

/// `telemetry::report_key_gauges` keeps the key gauges current without a sweeper, and stops when
/// its guard is dropped.
#[test]
fn key_gauges_are_reported_without_a_sweeper_until_the_guard_is_dropped() {
    use idemflow::conformance::{claim_for, done, id};
    use idemflow::store::{ClaimOutcome, OperatorStore};
    use std::time::Duration;

    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let processing = || sample(&handle.render(), "idemflow_processing_keys");
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let store = Arc::new(SqliteStore::connect("sqlite::memory:").await.unwrap());
            store.migrate().await.unwrap();
            let claim = |key: &str| claim_for(&id("gauges", key), "{}", Duration::from_secs(60));
            let ClaimOutcome::Claimed(first) = store.claim(&claim("g1")).await.unwrap() else {
                panic!("a new key is claimed");
            };
            let every = Duration::from_millis(20);
            // Until the gauge shows `want`, for up to 10 s (a busy machine runs the refresh late).
            let shows = |want: f64| async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while processing() != Some(want) && tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(every).await;
                }
                processing()
            };
            let gauges = idemflow::telemetry::report_key_gauges(
                store.clone() as Arc<dyn OperatorStore>,
                every,
            );
            assert_eq!(shows(1.0).await, Some(1.0), "{}", handle.render());
            store
                .finish(
                    &id("gauges", "g1"),
                    first.token,
                    &done(StoredResponse::new(201)),
                )
                .await
                .unwrap();
            assert_eq!(
                shows(0.0).await,
                Some(0.0),
                "refreshed: {}",
                handle.render()
            );
            drop(gauges);
            store.claim(&claim("g2")).await.unwrap();
            // Ten refresh periods: a refresh still running would have counted g2.
            tokio::time::sleep(every * 10).await;
            assert_eq!(
                processing(),
                Some(0.0),
                "the dropped guard stopped the refresh: {}",
                handle.render()
            );
        });
    });
}

/// `docs/operations.md` lists every metric, and the Grafana dashboard parses and graphs them.
#[test]
fn the_docs_list_every_metric_and_the_dashboard_parses() {
    let ops = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/docs/grafana-dashboard.json"
        ))
        .unwrap(),
    )
    .expect("the dashboard is JSON");
    let exprs: Vec<String> = dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().unwrap_or_default().to_owned())
        .collect();
    for name in idemflow::telemetry::ALL {
        assert!(
            ops.contains(&format!("`{name}`")),
            "operations.md does not list {name}"
        );
        assert!(
            exprs.iter().any(|e| e.contains(name)),
            "the dashboard does not graph {name}"
        );
    }
}
