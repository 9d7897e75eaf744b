-- Announcing ends to waiting duplicates (issue 24, `wait_in_flight` across processes). A
-- duplicate about to wait for a key's first attempt sets `waiters` on the key
-- (`Store::announce_end`); the write that ends that attempt (a finish or a failure from any
-- state, or a worker's or sweeper's release of its lease) then publishes the key on the channel
-- `idemflow_key_ends` (payload: the scope's length in bytes, ':', the scope, the key;
-- src/store/ends.rs), which every process with waiters LISTENs to. The trigger's WHEN condition
-- is false for every key nobody waits on, so those writes queue no trigger event and send no
-- NOTIFY: a NOTIFY serialises the commits of the transactions that send one, which the write path
-- must not pay for keys without waiters.

ALTER TABLE idempotency_keys ADD COLUMN waiters boolean NOT NULL DEFAULT false;

CREATE FUNCTION idemflow_announce_end() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idemflow_key_ends',
                      octet_length(NEW.scope)::text || ':' || NEW.scope || NEW.key);
    RETURN NULL;
END
$$;

CREATE TRIGGER idemflow_announce_end
    AFTER UPDATE ON idempotency_keys
    FOR EACH ROW
    WHEN (NEW.waiters AND OLD.state = 'processing'
          AND (NEW.state <> 'processing'
               OR (NEW.lease_owner IS NULL AND OLD.lease_owner IS NOT NULL)))
    EXECUTE FUNCTION idemflow_announce_end();
