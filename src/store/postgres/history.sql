SELECT (SELECT history FROM idempotency_key_tombstones WHERE scope = $1 AND key = $2) AS archived,
    (SELECT history FROM idempotency_keys WHERE scope = $1 AND key = $2) AS live
