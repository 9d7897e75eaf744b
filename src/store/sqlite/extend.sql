UPDATE idempotency_keys
SET lease_expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?4
WHERE scope = ?1
    AND key = ?2
    AND state = 'processing'
    AND lease_token = ?3
    AND lease_owner IS NOT NULL
RETURNING lease_expires_at
