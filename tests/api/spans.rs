//! The spans of the store calls: every backend opens them through `store::spans`, so one set of
//! names and fields; checked here on SQLite, through the executor.

use std::sync::{Arc, Mutex};

use idemflow::{Idempotency, IdempotentRequest, Outcome, StoredResponse};
use tracing::span::{Attributes, Id};
use tracing_subscriber::layer::{Context, SubscriberExt};

/// Records each new span's name and fields.
struct Spans(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!(" {}={value:?}", field.name()));
            }
        }
        let mut text = Text(attrs.metadata().name().to_owned());
        attrs.record(&mut text);
        self.0.lock().unwrap().push(text.0);
    }
}

/// Set for the child process that records the spans.
const CHILD: &str = "IDEMFLOW_SPANS_CHILD";

/// The spans are recorded in a child process of their own: tracing caches each call site's
/// interest across the process, so a test running beside others without a subscriber could
/// leave this one's subscriber unasked.
#[test]
fn a_claim_and_a_finish_open_their_spans_with_the_backend_and_the_key() {
    let out = crate::support::child_test(module_path!(), "child_records_the_spans")
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the child failed:\n{text}");
    assert!(text.contains("1 passed"), "the child ran no test:\n{text}");
}

#[test]
#[ignore = "the child process of spans::a_claim_and_a_finish_open_their_spans_with_the_backend_and_the_key"]
fn child_records_the_spans() {
    if std::env::var(CHILD).is_err() {
        eprintln!("skipping: run by the spans test as its child process");
        return;
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(Spans(seen.clone()));
    tracing::subscriber::set_global_default(subscriber).unwrap();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let store = idemflow::store::connect("sqlite::memory:").await.unwrap();
            store.migrate().await.unwrap();
            let idem = Idempotency::new(store);
            let request = IdempotentRequest::new("acct_1", "order-1", "orders.create", &1).unwrap();
            idem.execute(request, |_| async {
                Outcome::Succeeded(StoredResponse::new(201))
            })
            .await
            .unwrap();
        });
    let seen = seen.lock().unwrap().clone();
    for expected in [
        r#"idemflow.claim backend="sqlite" scope=acct_1 key=order-1 operation=orders.create"#,
        r#"idemflow.finish backend="sqlite" scope=acct_1 key=order-1 to=done actor="worker""#,
    ] {
        assert!(
            seen.iter().any(|s| s == expected),
            "no span {expected:?} among {seen:#?}"
        );
    }
}
