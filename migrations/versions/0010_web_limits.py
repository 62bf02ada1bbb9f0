"""web limits: jobs hidden from /v1/jobs (store false, deleted responses), admin panel sessions revoked at sign-out

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('hidden', sa.Boolean(), server_default=sa.false(), nullable=False))
    op.create_table('admin_sessions',
                    sa.Column('id', sa.String(length=64), nullable=False),
                    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
                    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
                    sa.PrimaryKeyConstraint('id', name=op.f('pk_admin_sessions')))


def downgrade() -> None:
    op.drop_table('admin_sessions')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('hidden')
