//! The answer stored with a finished key and replayed byte for byte.

use serde::{Deserialize, Serialize};

/// A stored response: status code, the headers chosen to keep, and the exact body bytes.
///
/// ```
/// use idemflow::StoredResponse;
/// let r = StoredResponse::json(201, &serde_json::json!({"payment_id": 1})).unwrap()
///     .with_header("location", "/payments/1");
/// assert_eq!(r.status(), 201);
/// assert_eq!(r.header("Content-Type"), Some("application/json"));
/// assert_eq!(r.body(), br#"{"payment_id":1}"#);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl StoredResponse {
    /// A response with a status code, no headers and an empty body.
    pub fn new(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    /// A JSON response: the value serialised as compact JSON, with
    /// `content-type: application/json`.
    ///
    /// # Examples
    ///
    /// ```
    /// use idemflow::StoredResponse;
    ///
    /// let answer = StoredResponse::json(201, &serde_json::json!({"id": "ch_1"}))?;
    /// assert_eq!(answer.status(), 201);
    /// assert_eq!(answer.header("Content-Type"), Some("application/json"));
    /// assert_eq!(answer.body(), br#"{"id":"ch_1"}"#);
    /// # Ok::<(), serde_json::Error>(())
    /// ```
    pub fn json<T: Serialize + ?Sized>(status: u16, value: &T) -> Result<Self, serde_json::Error> {
        Ok(Self::new(status)
            .with_header("content-type", "application/json")
            .with_body(serde_json::to_vec(value)?))
    }

    /// Adds a header (kept in order; names are compared case-insensitively on lookup).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the body bytes.
    pub fn with_body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }

    /// The status code.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// The stored headers, in the order they were added.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// The first header with this name (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body bytes.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// Parses the body as JSON.
    pub fn body_json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.body)
    }

    /// Splits the response into its parts.
    pub fn into_parts(self) -> (u16, Vec<(String, String)>, Vec<u8>) {
        (self.status, self.headers, self.body)
    }

    /// Builds a response from stored parts.
    pub fn from_parts(status: u16, headers: Vec<(String, String)>, body: Vec<u8>) -> Self {
        Self {
            status,
            headers,
            body,
        }
    }

    /// Keeps only the headers whose names are in `allow` (case-insensitive).
    pub fn retain_headers(&mut self, allow: &[String]) {
        self.headers
            .retain(|(n, _)| allow.iter().any(|a| a.eq_ignore_ascii_case(n)));
    }

    /// The size counted against the response cap: body plus header names and values.
    pub fn stored_size(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len())
                .sum::<usize>()
    }

    /// The headers encoded as the JSON array stored in the `response_headers` column.
    pub fn headers_json(&self) -> String {
        serde_json::to_string(&self.headers).unwrap_or_else(|_| "[]".to_owned())
    }
}
