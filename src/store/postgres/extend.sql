UPDATE idempotency_keys
SET lease_expires_at = statement_timestamp() + $4::bigint * interval '1 millisecond'
WHERE scope = $1::text
    AND key = $2::text
    AND state = 'processing'
    AND lease_token = $3::bigint
    AND lease_owner IS NOT NULL
RETURNING lease_expires_at
