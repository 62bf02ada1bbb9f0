"""tenant budget counters: tokens held against the monthly budget by unfinished jobs, and used this month

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""
from datetime import datetime, timezone

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.add_column(sa.Column('budget_reserved', sa.BigInteger(), server_default='0', nullable=False))
        batch.add_column(sa.Column('budget_used', sa.BigInteger(), server_default='0', nullable=False))
        batch.add_column(sa.Column('budget_period', sa.String(length=7), nullable=True))
    month = datetime.now(timezone.utc).strftime("%Y-%m")
    op.execute("UPDATE tenants SET budget_reserved = coalesce((SELECT sum(jobs.estimated_tokens) FROM jobs "
               "WHERE jobs.tenant_id = tenants.id AND jobs.status IN ('queued', 'running')), 0)")
    op.execute(f"UPDATE tenants SET budget_period = '{month}', budget_used = coalesce((SELECT "
               f"usage.prompt_tokens + usage.completion_tokens FROM usage WHERE usage.tenant_id = tenants.id "
               f"AND usage.period = '{month}'), 0)")


def downgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('budget_period')
        batch.drop_column('budget_used')
        batch.drop_column('budget_reserved')
