//! The fake Postmark (`POST /email`, `GET /messages/outbound`).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::{get, post};
use serde_json::{Value, json};

use super::server::{EffectRequest, FakeApi, Received, Shared, fake_handle};
use super::{
    Effect, Searchable, header_value, json_object, json_response, metadata_text, query_pairs,
    raw_response,
};
use crate::provider::postmark::METADATA_KEY;

fake_handle! {
    /// An in-process Postmark look-alike (see the [module docs](super)). It has no idempotency:
    /// every accepted request is one more email in the ledger.
    pub struct FakePostmark(PostmarkState);
    routes: Router::new()
            .route("/email", post(send))
            .route("/messages/outbound", get(search)),
    ledger: "The emails sent.",
    faults: "Fault injection and latency / search-lag settings.",
}

#[derive(Debug, Default)]
struct PostmarkState {
    messages: Searchable,
}

impl FakePostmark {
    /// The server token the fake accepts (`X-Postmark-Server-Token`).
    pub const API_KEY: &'static str = "pm_test_idemflow_fake";
}

fn pm_error(status: u16, code: i64, message: &str) -> Response {
    json_response(status, &json!({"ErrorCode": code, "Message": message}), &[])
}

impl FakeApi for PostmarkState {
    fn refusal(headers: &HeaderMap) -> Option<Response> {
        (header_value(headers, "x-postmark-server-token").as_deref() != Some(FakePostmark::API_KEY))
            .then(|| pm_error(401, 10, "Request does not contain a valid Server token."))
    }

    fn server_error(status: u16) -> Response {
        pm_error(status, 0, "injected server error (nothing sent)")
    }

    fn rate_limited() -> Value {
        json!({"ErrorCode": 429, "Message": "Rate limit exceeded."})
    }
}

async fn send(State(s): State<Arc<Shared<PostmarkState>>>, request: EffectRequest) -> Response {
    let EffectRequest { body, delivery, .. } = request;
    let Some(email) = json_object(&body) else {
        return pm_error(422, 402, "Received invalid JSON input.");
    };
    let to = email
        .get("To")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    if email.get("From").and_then(Value::as_str).is_none() || to.is_empty() {
        return pm_error(422, 300, "Invalid email request");
    }
    if to.contains("inactive") {
        return pm_error(
            422,
            406,
            "You tried to send to recipient(s) that have been marked as inactive.",
        );
    }
    let exec = s.execute(move |s, n| {
        let id = format!("b7bc2f4a-e38e-4336-af7d-{n:012}");
        let now = chrono::Utc::now().to_rfc3339();
        let metadata = email.get("Metadata").cloned().unwrap_or_else(|| json!({}));
        s.common.ledger.push(Effect {
            id: id.clone(),
            kind: "email",
            idempotency_key: None,
            metadata_key: metadata_text(metadata.get(METADATA_KEY)),
            status: "sent".to_owned(),
            request: email.clone(),
        });
        let record = json!({
            "MessageID": id,
            "To": to.split(',').map(|e| json!({"Email": e.trim(), "Name": null})).collect::<Vec<_>>(),
            "From": email.get("From"),
            "Subject": email.get("Subject"),
            "Status": "Sent",
            "ReceivedAt": now,
            "Metadata": metadata,
        });
        s.messages.push(s.common.faults.search_lag(), record);
        json!({"To": to, "SubmittedAt": now, "MessageID": id, "ErrorCode": 0, "Message": "OK"})
    });
    let Some(answer) = exec.await else {
        return pm_error(500, 0, "fake failed");
    };
    let bytes = serde_json::to_vec(&answer).unwrap_or_default();
    delivery.deliver(raw_response(200, bytes, &[])).await
}

async fn search(
    State(s): State<Arc<Shared<PostmarkState>>>,
    Received { uri, .. }: Received,
) -> Response {
    let params = query_pairs(&uri);
    let count = params
        .iter()
        .find(|(k, _)| k == "count")
        .and_then(|(_, v)| v.parse::<usize>().ok());
    let Some(count) = count.filter(|c| (1..=500).contains(c)) else {
        return pm_error(422, 300, "count is required (1-500)");
    };
    let offset = params
        .iter()
        .find(|(k, _)| k == "offset")
        .and_then(|(_, v)| v.parse::<usize>().ok())
        .unwrap_or(0);
    let filters: Vec<(String, String)> = params
        .iter()
        .filter_map(|(k, v)| {
            k.strip_prefix("metadata_")
                .map(|m| (m.to_owned(), v.clone()))
        })
        .collect();
    let matching = s.messages.find(|m| {
        filters
            .iter()
            .all(|(k, v)| m["Metadata"][k].as_str() == Some(v.as_str()))
    });
    let total = matching.len();
    let page: Vec<Value> = matching.into_iter().skip(offset).take(count).collect();
    json_response(200, &json!({"TotalCount": total, "Messages": page}), &[])
}
