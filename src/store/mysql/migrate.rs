//! `MySqlStore::migrate`: the migrations, then the procedures, one instance at a time.
//!
//! sqlx's MySQL migrator locks with `GET_LOCK(name, -1)`, which MariaDB answers with `NULL` at
//! once (a negative timeout is not "forever" there), so instances starting together would apply
//! the same migration twice. The lock here, named after the database, is taken on the
//! connection that then runs everything.

use std::time::Duration;

use sqlx::MySqlPool;

use super::{BACKEND, migrator, procedures};
use crate::store::StoreError;

/// How long an instance waits for another's migration.
const LOCK_WAIT: Duration = Duration::from_secs(300);

fn failed(source: impl Into<crate::error::BoxError>) -> StoreError {
    StoreError::Migrate {
        backend: BACKEND,
        source: source.into(),
    }
}

pub(super) async fn run(pool: &MySqlPool) -> Result<(), StoreError> {
    let mut conn = pool.acquire().await.map_err(failed)?;
    let locked: Option<i64> = sqlx::query_scalar(include_str!("migrate_lock.sql"))
        .bind(LOCK_WAIT.as_secs() as i64)
        .fetch_one(&mut *conn)
        .await
        .map_err(failed)?;
    if locked != Some(1) {
        return Err(failed(format!(
            "another instance held the migration lock for {} s",
            LOCK_WAIT.as_secs()
        )));
    }
    let result = async {
        // `run_direct` is `run` on a connection without `run`'s `Acquire` bound, which an
        // `async_trait` future cannot prove `Send` for (sqlx names it for this).
        migrator()
            .run_direct(None, &mut *conn, false)
            .await
            .map_err(failed)?;
        // Each unless it is there (`IF NOT EXISTS`); they name the tables, so they come after.
        for text in procedures::PROCEDURES {
            sqlx::raw_sql(text)
                .execute(&mut *conn)
                .await
                .map_err(failed)?;
        }
        Ok(())
    }
    .await;
    // Closing the connection would release the lock too; an error here leaves that to the pool.
    let unlocked = sqlx::query(include_str!("migrate_unlock.sql"))
        .execute(&mut *conn)
        .await;
    if unlocked.is_err() {
        conn.detach();
    }
    result
}
