//! Bad input gets a typed error that names the problem, and leaves no row behind.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::support::sqlite::memory;
use idemflow::store::sqlite::SqliteStore;
use idemflow::{
    Error, Idempotency, IdempotentRequest, KeyState, Outcome, Store, StoredResponse,
    error::RequestError, key::KeyError,
};

async fn rows(store: &SqliteStore) -> (i64, i64) {
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(store.writer_pool())
        .await
        .unwrap();
    let tombstones: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_key_tombstones")
        .fetch_one(store.writer_pool())
        .await
        .unwrap();
    (keys, tombstones)
}

#[tokio::test]
async fn malformed_keys_and_scopes_are_refused_by_name() {
    let long = "k".repeat(256);
    let cases: [(&str, &str, &str); 6] = [
        ("acct", "", "idempotency key is empty"),
        ("acct", &long, "256 bytes long"),
        ("acct", "has space", "0x20"),
        ("acct", "new\nline", "0x0A"),
        ("acct", "caf\u{e9}", "0xC3"),
        ("", "k1", "scope is empty"),
    ];
    for (scope, key, needle) in cases {
        let err = IdempotentRequest::new(scope, key, "payments.create", &serde_json::json!({}))
            .unwrap_err();
        assert_eq!(err.http_status(), 400, "{err}");
        assert!(
            err.to_string().contains(needle),
            "{err:?} should mention {needle}"
        );
        match (&err, scope.is_empty()) {
            (RequestError::InvalidScope(KeyError::Empty { what: "scope" }), true) => {}
            (RequestError::InvalidKey(_), false) => {}
            other => panic!("wrong variant: {other:?}"),
        }
    }
    assert!(matches!(
        IdempotentRequest::new("acct", "k", "", &1),
        Err(RequestError::InvalidOperation(KeyError::Empty { .. }))
    ));
}

#[tokio::test]
async fn invalid_json_body_is_refused() {
    let err =
        IdempotentRequest::from_json_bytes("acct", "k1", "payments.create", b"{\"amount\": 5,}")
            .unwrap_err();
    assert!(matches!(err, RequestError::InvalidJson(_)), "{err:?}");
    assert!(err.to_string().contains("not valid JSON"));
    assert_eq!(err.http_status(), 400);
    let ok = IdempotentRequest::from_json_bytes(
        "acct",
        "k1",
        "payments.create",
        b" {\"b\":1, \"a\":2} ",
    )
    .unwrap();
    assert_eq!(ok.canonical_body(), r#"{"a":2,"b":1}"#);
}

#[tokio::test]
async fn duplicate_json_object_keys_are_refused_not_last_wins() {
    // serde_json keeps the last of two equal member names: `{"amount":1,"amount":900}` used to
    // fingerprint as `{"amount":900}`, the same request as a body that never named 1.
    for body in [
        &br#"{"amount": 1, "amount": 900}"#[..],
        br#"{"a": {"x": 1, "y": 2, "x": 1}}"#,
        br#"[{"k": null}, {"k": 1, "\u006b": 2}]"#,
    ] {
        let err =
            IdempotentRequest::from_json_bytes("acct", "k1", "payments.create", body).unwrap_err();
        assert!(
            matches!(&err, RequestError::DuplicateJsonKey { .. }),
            "{}: {err:?}",
            String::from_utf8_lossy(body)
        );
        assert_eq!(err.http_status(), 400);
        assert!(err.to_string().contains("more than once"), "{err}");
    }
    let Err(RequestError::DuplicateJsonKey { name }) = IdempotentRequest::from_json_bytes(
        "acct",
        "k1",
        "payments.create",
        br#"{"amount": 1, "amount": 900}"#,
    ) else {
        panic!("expected DuplicateJsonKey");
    };
    assert_eq!(name, "amount");
    // The same name in different objects is fine.
    let ok = IdempotentRequest::from_json_bytes(
        "acct",
        "k1",
        "payments.create",
        br#"{"a": {"x": 1}, "b": {"x": 1}, "x": [{"x": 2}]}"#,
    )
    .unwrap();
    assert_eq!(
        ok.canonical_body(),
        r#"{"a":{"x":1},"b":{"x":1},"x":[{"x":2}]}"#
    );
}

#[tokio::test]
async fn serialised_bodies_with_duplicate_members_are_refused() {
    // A `#[serde(flatten)]` map can emit a member its struct already wrote.
    #[derive(serde::Serialize)]
    struct Body {
        amount: u32,
        #[serde(flatten)]
        extra: std::collections::BTreeMap<String, u32>,
    }
    let body = Body {
        amount: 1,
        extra: [("amount".to_owned(), 900)].into_iter().collect(),
    };
    let err = IdempotentRequest::new("acct", "k1", "payments.create", &body).unwrap_err();
    assert!(
        matches!(err, RequestError::DuplicateJsonKey { ref name } if name == "amount"),
        "{err:?}"
    );
}

#[tokio::test]
async fn oversized_request_leaves_no_row() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone()).max_request_bytes(100);
    let body = serde_json::json!({"blob": "x".repeat(200)});
    let err = idem
        .execute(
            IdempotentRequest::new("acct", "big", "op", &body).unwrap(),
            |_ctx| async { panic!("must not run") },
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Request(RequestError::RequestTooLarge { limit: 100, .. })
        ),
        "{err}"
    );
    assert_eq!(rows(&store).await, (0, 0));
}

#[tokio::test]
async fn oversized_response_names_the_problem_and_is_never_rerun() {
    let store = memory().await;
    let idem = Idempotency::new(store.clone()).max_response_bytes(1024);
    let runs = Arc::new(AtomicUsize::new(0));
    let request =
        || IdempotentRequest::new("acct", "huge", "op", &serde_json::json!({"a": 1})).unwrap();
    let r = runs.clone();
    let err = idem
        .execute(request(), |_ctx| async move {
            r.fetch_add(1, Ordering::SeqCst);
            Outcome::Succeeded(StoredResponse::new(200).with_body(vec![b'x'; 4096]))
        })
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::ResponseTooLarge { limit: 1024, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("exceeds the cap of 1024 bytes"));
    // The operation ran, so the key is not deleted (a retry would run it again): it is a whole
    // row in failed(permanent) with no truncated body, and the retry is told why.
    let row = store.get(request().id()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Failed { retryable: false });
    assert!(row.response.is_none());
    assert!(row.error.unwrap().contains("4096 bytes"));
    let r = runs.clone();
    let again = idem
        .execute(request(), |_ctx| async move {
            r.fetch_add(1, Ordering::SeqCst);
            Outcome::Succeeded(StoredResponse::new(200))
        })
        .await
        .unwrap_err();
    assert!(matches!(again, Error::NoStoredResponse { .. }), "{again}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn bad_store_urls_are_config_errors() {
    let err = SqliteStore::connect("postgres://nope").await.unwrap_err();
    assert!(matches!(err, idemflow::StoreError::Config(_)), "{err}");
    let err = SqliteStore::connect("sqlite:///definitely/not/a/dir/x.db")
        .await
        .unwrap_err();
    assert!(
        matches!(err, idemflow::StoreError::Database { .. }),
        "{err}"
    );
}
