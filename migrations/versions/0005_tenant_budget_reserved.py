"""tenant budget reservations: tokens held against the monthly budget by unfinished jobs

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.add_column(sa.Column('budget_reserved', sa.BigInteger(), server_default='0', nullable=False))
    op.execute("UPDATE tenants SET budget_reserved = coalesce((SELECT sum(jobs.estimated_tokens) FROM jobs "
               "WHERE jobs.tenant_id = tenants.id AND jobs.status IN ('queued', 'running')), 0)")


def downgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('budget_reserved')
