"""web limits: per-tenant concurrent online requests, files and stored bytes; files that expire; jobs hidden from
/v1/jobs (store false, deleted responses); admin panel sessions revoked at sign-out

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
    with op.batch_alter_table('quotas') as batch:    # existing tenants get the new tenants' defaults
        batch.add_column(sa.Column('max_concurrent_requests', sa.Integer(), server_default='16', nullable=True))
        batch.add_column(sa.Column('max_files', sa.Integer(), server_default='10000', nullable=True))
        batch.add_column(sa.Column('max_storage_bytes', sa.BigInteger(), server_default=str(10 << 30),
                                   nullable=True))
    with op.batch_alter_table('files') as batch:
        batch.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
        batch.create_index('ix_files_expires_at', ['expires_at'])
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('hidden', sa.Boolean(), server_default=sa.false(), nullable=False))
    op.create_table('admin_sessions',
                    sa.Column('id', sa.String(length=64), nullable=False),
                    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
                    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
                    sa.PrimaryKeyConstraint('id', name=op.f('pk_admin_sessions')))


def downgrade() -> None:
    op.drop_table('admin_sessions')
    with op.batch_alter_table('files') as batch:
        batch.drop_index('ix_files_expires_at')
        batch.drop_column('expires_at')
    with op.batch_alter_table('quotas') as batch:
        batch.drop_column('max_storage_bytes')
        batch.drop_column('max_files')
        batch.drop_column('max_concurrent_requests')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('hidden')
