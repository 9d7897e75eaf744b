//! The executor-level tests' fake card processor ([`Charger`]) and request body ([`body`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idemflow::{Context, Outcome, StoredResponse};

/// A fake card processor: counts charges and answers with the charge number.
#[derive(Debug, Default)]
pub struct Charger {
    pub charges: AtomicUsize,
    pub keys: std::sync::Mutex<Vec<String>>,
}

impl Charger {
    pub fn count(&self) -> usize {
        self.charges.load(Ordering::SeqCst)
    }

    pub async fn charge(self: Arc<Self>, ctx: Context, amount: u64) -> Outcome {
        let n = self.charges.fetch_add(1, Ordering::SeqCst) + 1;
        self.keys
            .lock()
            .unwrap()
            .push(ctx.provider_key().to_owned());
        Outcome::Succeeded(
            StoredResponse::json(201, &serde_json::json!({"payment_id": n, "amount": amount}))
                .unwrap()
                .with_header("Location", format!("/payments/{n}"))
                .with_header("X-Request-Id", format!("req-{n}")),
        )
    }
}

pub fn body(amount: u64) -> serde_json::Value {
    serde_json::json!({"user": "alice", "amount": amount})
}
